"""``replicheck campaign``: run the fault-injection matrix (or the soak) and write the results.

Registration is cheap (no torch import); the work happens in :func:`run`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "campaign",
        help="inject hardware-like faults into short guarded trainings and write the detection table",
        description="Run fault scenarios as local multi-process jobs (gloo, simulated nodes) and write "
        "results.json, results.md and one timeline PNG per scenario; or, with --soak N, run "
        "clean training verified on every step until N verification pairs and count false alarms.",
    )
    p.add_argument("--out", default="campaign-results", help="output directory (default: %(default)s)")
    p.add_argument(
        "--scenarios",
        default=None,
        help="comma-separated scenario names to run (a trailing * matches a prefix); default: all",
    )
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes (default: %(default)s)")
    p.add_argument("--gpus-per-node", type=int, default=2, help="ranks per node (default: %(default)s)")
    p.add_argument(
        "--mode", choices=("exact", "tolerant"), default="exact", help="guard mode (default: %(default)s)"
    )
    p.add_argument(
        "--verify-every", type=int, default=10, help="replay period in steps (default: %(default)s)"
    )
    p.add_argument(
        "--weights-every", type=int, default=None, help="weight-check period (default: --verify-every)"
    )
    p.add_argument("--steps", type=int, default=36, help="steps per scenario (default: %(default)s)")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of weights, data and faults (default: %(default)s)"
    )
    p.add_argument("--fault-rank", type=int, default=1, help="the faulty rank (default: %(default)s)")
    p.add_argument("--tiny", action="store_true", help="use the tiny soak model (fast smoke runs)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG timelines")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--soak",
        type=int,
        default=None,
        metavar="N",
        help="instead: clean training verified every step until N verification pairs",
    )
    p.add_argument(
        "--bf16",
        action="store_true",
        help="with --soak: tolerant mode, bf16 autocast and simulated kernel noise on every rank, "
        "the tolerances left to the guard (writes soak-bf16.md/json)",
    )
    p.add_argument(
        "--noise",
        default=None,
        metavar="SHAPES",
        help="with --soak: simulated kernel noise on the final norm, a comma list of gaussian, "
        "additive, ulp, heavy (every rank) and bias (a constant bias on rank 1), or none; "
        "default: all of them with --bf16, none otherwise (needs tolerant mode)",
    )
    p.add_argument(
        "--no-restart",
        action="store_true",
        help="instead: the no-restart rows (torchft replica groups, real lighthouse; needs torchft): "
        "writes no-restart.json and the '## No restart (torchft)' section of results.md, keeping the rest",
    )
    p.set_defaults(func=run)


class _Progress:
    """tqdm on a terminal when installed (the ``progress`` extra), else one plain line per update
    on stderr: a bar's carriage-return frames would litter a pipe or a log file."""

    def __init__(self, total: int, desc: str, unit: str, enabled: bool) -> None:
        self.enabled, self.n, self.total, self.desc = enabled, 0, total, desc
        self._bar: Any = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                self._bar = None

    def update_to(self, n: int, note: str = "") -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(max(0, n - self._bar.n))
            if note:
                self._bar.set_postfix_str(note)
        else:
            print(f"{self.desc}: {n}/{self.total} {note}", file=sys.stderr, flush=True)
        self.n = n

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _command() -> str:
    return (
        "replicheck " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["campaign"] else "replicheck campaign"
    )


def run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)
    out = Path(args.out)
    if args.no_restart:
        return _no_restart(args, out)
    if args.soak is not None:
        return _soak(args, out)
    if args.noise is not None:
        print("replicheck campaign: --noise applies to --soak only", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    from replicheck.campaign import plots, report
    from replicheck.campaign.runner import run_campaign
    from replicheck.campaign.scenarios import JobDefaults, default_scenarios, select, soak_model
    from replicheck.faults.errors import FaultConfigError

    try:
        scenarios = select(default_scenarios(), args.scenarios)
        extra: dict[str, Any] = {"model": soak_model(), "batch": 2} if args.tiny else {}
        defaults = JobDefaults(
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            mode=args.mode,
            verify_every=args.verify_every,
            weights_every=args.weights_every,
            steps=args.steps,
            seed=args.seed,
            fault_rank=args.fault_rank,
            **extra,
        )
    except FaultConfigError as exc:
        print(f"replicheck campaign: {exc}", file=sys.stderr)
        return 2
    if args.list:
        for s in scenarios:
            print(f"{s.name:22s} {s.title}")
        return 0
    bar = _Progress(len(scenarios), "campaign", "scenario", not args.no_progress)
    started = time.monotonic()

    def done(o: Any) -> None:
        bar.update_to(bar.n + 1, f"{o.name}: {'ok' if o.as_expected else 'UNEXPECTED'}")

    outcomes = run_campaign(scenarios, defaults, on_done=done)
    bar.close()
    rows = [o.to_dict() for o in outcomes]
    m = defaults.model
    meta = {
        "command": _command(),
        "seconds": round(time.monotonic() - started, 1),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "job": (
            f"Llama-style decoder d_model {m.d_model}, {m.n_layers} blocks, {m.seq_len} tokens, batch "
            f"{defaults.batch} per rank, {defaults.steps} steps (0–{defaults.steps - 1}), AdamW, verify every "
            f"{defaults.verify_every} unless the row says otherwise, faulty rank {defaults.fault_rank}"
        ),
    }
    report.write_json(rows, out / "results.json", meta)
    make_plots = not args.no_plots and plots.available()
    if make_plots:
        for row in rows:
            plots.timeline(row, out / f"{row['name']}.png")
    report.write_markdown(rows, out / "results.md", meta, plots=make_plots)
    print(report.markdown(rows, meta, plots=make_plots).split("## Published")[0])
    if not args.no_plots and not make_plots:
        print(
            "no plots: matplotlib is not installed; pip install 'replicheck[plot]' to get them",
            file=sys.stderr,
        )
    print(f"wrote {out / 'results.json'} and {out / 'results.md'}", file=sys.stderr)
    return 0 if all(o.as_expected for o in outcomes) else 1


def _soak(args: argparse.Namespace, out: Path) -> int:
    import json

    import torch

    from replicheck.campaign.soak import (
        NOISE_SHAPES,
        SoakConfig,
        bf16_soak,
        parse_noise,
        run_soak,
        soak_markdown,
        soak_noise,
    )
    from replicheck.faults.errors import FaultConfigError

    try:
        shapes = parse_noise(args.noise) if args.noise is not None else None
        if shapes and not args.bf16 and args.mode == "exact":
            raise FaultConfigError(
                "--noise needs tolerant mode (--mode tolerant, or --bf16): exact mode compares "
                "bits and alarms on any kernel noise"
            )
        cfg = SoakConfig(
            pairs=args.soak,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            mode=args.mode,
            weights_every=args.weights_every or 1,
            seed=args.seed,
            noise=soak_noise(shapes or ()),
        )
    except FaultConfigError as exc:
        print(f"replicheck campaign: {exc}", file=sys.stderr)
        return 2
    name = "soak"
    if args.bf16:
        cfg = bf16_soak(cfg, tiny=args.tiny, noise=NOISE_SHAPES if shapes is None else shapes)
        name = "soak-bf16"
    out.mkdir(parents=True, exist_ok=True)
    bar = _Progress(cfg.steps, "soak", "step", not args.no_progress)
    update: Callable[[int], None] = bar.update_to
    result = run_soak(cfg, progress=update)
    bar.close()
    (out / f"{name}.json").write_text(json.dumps(result.to_dict(), indent=1))
    text = soak_markdown(result, _command(), os.cpu_count() or 0, torch.__version__)
    (out / f"{name}.md").write_text(text)
    print(text)
    return 0 if result.false_alarms == 0 else 1


def _no_restart(args: argparse.Namespace, out: Path) -> int:
    """The no-restart rows: their own section of ``results.md`` (the main table is kept)."""
    import json
    import tempfile
    import time

    from replicheck.demo import DemoError
    from replicheck.no_restart_campaign import (
        NoRestartCampaign,
        markdown,
        no_restart_scenarios,
        run_no_restart_campaign,
        write_section,
    )

    c = NoRestartCampaign()
    bar = _Progress(len(no_restart_scenarios(c)), "no-restart", "scenario", not args.no_progress)
    t0 = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="replicheck-no-restart-") as tmp:
            rows = run_no_restart_campaign(
                c, Path(tmp), on_done=lambda r: bar.update_to(bar.n + 1, str(r["scenario"]))
            )
    except DemoError as exc:
        print(f"replicheck campaign: {exc}", file=sys.stderr)
        return 2
    finally:
        bar.close()
    wall = time.monotonic() - t0
    out.mkdir(parents=True, exist_ok=True)
    (out / "no-restart.json").write_text(json.dumps(rows, indent=2, default=str) + "\n")
    write_section(out / "results.md", markdown(rows, c, _command(), wall))
    print(
        f"wrote {out / 'no-restart.json'} and the no-restart section of {out / 'results.md'}", file=sys.stderr
    )
    return 0 if all(r["as_expected"] for r in rows) else 1
