"""``replicheck selftest``: run the known-answer self-test on this node's devices (by default every
GPU it has, else the CPU) and report each one's fingerprint.

Exit status: 0 every device ran (and matched ``--expect`` and each other), 1 a mismatch (the
node computes wrongly), 3 the test could not run (no such device, a driver error): a node that
could not be tested is not a node that failed the test. 2 is a usage error.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import socket
import sys
from typing import Any

EXIT_MISMATCH = 1
EXIT_USAGE = 2
EXIT_COULD_NOT_RUN = 3
_FINGERPRINT = re.compile(r"[0-9a-f]{16}")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "selftest",
        help="known-answer self-test of this node's devices (triage)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--device",
        action="append",
        default=None,
        help="device to test, repeatable (cpu, cuda, cuda:N); default: every GPU of the node, else cpu",
    )
    parser.add_argument(
        "--expect", metavar="HEX", help="fingerprint of a healthy node (16 hex digits); exit 1 if different"
    )
    parser.add_argument("--node", default=None, help="node name to report (default: host name)")
    parser.add_argument("--steps", type=int, default=3, help="forward/backward steps")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.set_defaults(func=_selftest)


def _devices(asked: list[str] | None) -> list[str]:
    import torch

    if asked:
        return asked
    if torch.cuda.is_available():
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu"]


def _usable(device: str) -> str | None:
    """Why ``device`` cannot run the test, or None."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        return str(exc)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available on this machine"
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            return f"no {device}: this machine has {torch.cuda.device_count()} GPU(s)"
    elif dev.type != "cpu":
        return f"unsupported device type {dev.type!r}"
    return None


def _selftest(args: argparse.Namespace) -> int:
    expect = None
    if args.expect is not None:
        expect = args.expect.strip().lower()
        if not _FINGERPRINT.fullmatch(expect):
            print(
                f"replicheck selftest: error: --expect must be 16 hex digits, got {args.expect!r}",
                file=sys.stderr,
            )
            return EXIT_USAGE
    if args.steps < 1:
        print("replicheck selftest: error: --steps must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    from replicheck.selftest import SelftestConfig, run_selftest

    node = args.node or socket.gethostname()
    reports: list[dict[str, Any]] = []
    for device in _devices(args.device):
        why = _usable(device)
        if why is None:
            try:
                result = run_selftest(SelftestConfig(device=device, steps=args.steps))
            except Exception as exc:  # noqa: BLE001 - any driver/runtime failure means "could not run"
                why = f"{type(exc).__name__}: {exc}"
        if why is not None:
            reports.append({"device": device, "error": why})
            continue
        reports.append(
            {
                "device": result.device,
                "fingerprint": result.fingerprint,
                "loss": result.loss,
                "seconds": round(result.seconds, 3),
                "passed": None if expect is None else result.fingerprint == expect,
            }
        )
    ran = [r for r in reports if "fingerprint" in r]
    prints = {r["fingerprint"] for r in ran}
    if len(prints) == 1:
        fingerprint = next(iter(prints))
    else:  # devices disagree (or none ran): nothing a healthy reference node reproduces
        joined = ",".join(sorted(prints)).encode()
        fingerprint = "mixed-" + hashlib.blake2b(joined, digest_size=8).hexdigest() if prints else None
    mismatch = len(prints) > 1 or any(r.get("passed") is False for r in ran)
    could_not_run = len(ran) < len(reports)
    status = EXIT_MISMATCH if mismatch else (EXIT_COULD_NOT_RUN if could_not_run else 0)
    passed = False if mismatch else (None if expect is None or could_not_run else True)
    if args.json:
        out = {
            "node": node,
            "fingerprint": fingerprint,
            "devices": reports,
            "passed": passed,
            "status": {0: "ok", EXIT_MISMATCH: "mismatch", EXIT_COULD_NOT_RUN: "could not run"}[status],
        }
        if len(ran) == 1 and len(reports) == 1:  # one device: its figures at the top, as before
            out |= {"loss": ran[0]["loss"], "device": ran[0]["device"], "seconds": ran[0]["seconds"]}
        print(json.dumps(out))
    else:
        for r in reports:
            if "error" in r:
                print(f"{node} {r['device']} could not run: {r['error']}")
                continue
            verdict = (
                "" if r["passed"] is None else ("  matches" if r["passed"] else f"  DIFFERS from {expect}")
            )
            print(f"{node} {r['device']} fingerprint {r['fingerprint']}{verdict}")
        if len(prints) > 1:
            print(f"{node}: devices DISAGREE ({len(prints)} different fingerprints)")
    if could_not_run:
        print("replicheck selftest: some device(s) could not run the test (exit 3)", file=sys.stderr)
    return status
