"""``replicheck demo``: the whole detection-to-recovery story on one machine."""

from __future__ import annotations

import argparse
import json
import sys


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="detect, cordon, triage, approve, replace and resume on a local cluster")
    p.add_argument("--scenario", default="aws-persistent-3n", help="campaign scenario to play")
    p.add_argument(
        "--out",
        default="demo-out",
        help="output directory: new, empty, or an earlier demo's (a non-empty other directory is refused)",
    )
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--yes", action="store_true", help="approve without asking (also when no terminal)")
    p.add_argument("--json", action="store_true", help="print the facts as JSON at the end")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from replicheck.demo import DemoConfig, run_demo

    def ask(prompt: str) -> bool:
        return input(prompt).strip().lower() in ("y", "yes")

    interactive = sys.stdin.isatty() and not args.yes
    cfg = DemoConfig(
        scenario=args.scenario,
        out_dir=args.out,
        steps=args.steps,
        approve=ask if interactive else None,
        approver="operator" if interactive else "demo --yes",
    )
    from replicheck.demo import DemoError
    from replicheck.faults.errors import FaultConfigError

    try:
        facts = run_demo(cfg)
    except (DemoError, FaultConfigError) as exc:
        print(f"replicheck demo: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(
            json.dumps(
                {k: v for k, v in facts.items() if k not in ("timeline", "losses")}, indent=2, default=str
            )
        )
    if facts.get("detected") and facts.get("final_equal") is False:
        return 1
    return 0
