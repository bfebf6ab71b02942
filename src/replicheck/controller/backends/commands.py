"""Running scheduler commands: argument lists only (never a shell), with a timeout, and
errors sorted into transient (retry) and permanent (fail the incident)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from replicheck.controller.errors import PermanentBackendError, TransientBackendError

# Substrings of Slurm client errors that a retry can cure (controller restarting, network).
TRANSIENT_MARKERS = (
    "unable to contact slurm controller",
    "connection refused",
    "socket timed out",
    "zero bytes were transmitted",
    "communication connection failure",
    "temporarily unavailable",
    "in standby mode",
    "connection reset",
    "timed out",
)
# Errors that will not change by asking again.
PERMANENT_MARKERS = (
    "invalid node name",
    "invalid job id",
    "access/permission denied",
    "permission denied",
    "invalid node state",
    "unrecognized option",
    "invalid user",
)


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


class CommandRunner:
    """Runs commands with a fixed environment addition (e.g. SLURM_CONF) and timeout."""

    def __init__(self, env: Mapping[str, str] | None = None, timeout_s: float = 30.0) -> None:
        self._env = dict(env or {})
        self._timeout = timeout_s

    def run(
        self, argv: Sequence[str], *, check: bool = True, timeout_s: float | None = None
    ) -> CommandResult:
        """Run ``argv``; with ``check`` a non-zero exit raises a classified BackendError.
        ``timeout_s`` overrides the runner's timeout for a command that runs long (a job)."""
        args = tuple(argv)
        timeout = self._timeout if timeout_s is None else timeout_s
        env = {**os.environ, **self._env}
        try:
            proc = subprocess.run(
                args,
                capture_output=True,
                text=True,
                timeout=timeout,
                env=env,
                check=False,
                stdin=subprocess.DEVNULL,
            )
        except FileNotFoundError as exc:
            raise PermanentBackendError(f"command not found: {args[0]}") from exc
        except PermissionError as exc:
            raise PermanentBackendError(f"cannot run {args[0]}: {exc}") from exc
        except subprocess.TimeoutExpired as exc:
            raise TransientBackendError(f"{_show(args)} timed out after {timeout:g}s") from exc
        result = CommandResult(args, proc.returncode, proc.stdout, proc.stderr)
        if check and proc.returncode != 0:
            raise classify(result)
        return result


def classify(result: CommandResult) -> TransientBackendError | PermanentBackendError:
    """The error for a failed command, transient unless its message says otherwise."""
    text = (result.stderr or result.stdout).strip()
    message = f"{_show(result.argv)} exited {result.returncode}: {text or 'no output'}"
    lowered = text.lower()
    if any(m in lowered for m in PERMANENT_MARKERS):
        return PermanentBackendError(message)
    return TransientBackendError(message)


def _show(args: Sequence[str]) -> str:
    return " ".join(args[:4]) + (" ..." if len(args) > 4 else "")
