"""``replicheck selftest``: run the known-answer self-test on this node and print its fingerprint."""

from __future__ import annotations

import argparse
import json
import socket
import sys
from typing import Any

EXIT_MISMATCH = 1


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("selftest", help="known-answer self-test of this node (triage)")
    parser.add_argument("--device", default="cpu", help="device to test (cpu, cuda, cuda:N)")
    parser.add_argument("--expect", metavar="HEX", help="fingerprint of a healthy node; exit 1 if different")
    parser.add_argument("--node", default=None, help="node name to report (default: host name)")
    parser.add_argument("--steps", type=int, default=3, help="forward/backward steps")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.set_defaults(func=_selftest)


def _selftest(args: argparse.Namespace) -> int:
    from replicheck.selftest import SelftestConfig, run_selftest

    try:
        config = SelftestConfig(device=args.device, steps=args.steps)
        result = run_selftest(config)
    except (ValueError, RuntimeError) as exc:
        print(f"replicheck: error: self-test could not run: {exc}", file=sys.stderr)
        return 2
    passed = None if args.expect is None else result.fingerprint == args.expect.strip().lower()
    node = args.node or socket.gethostname()
    if args.json:
        print(
            json.dumps(
                {
                    "node": node,
                    "fingerprint": result.fingerprint,
                    "loss": result.loss,
                    "device": result.device,
                    "seconds": round(result.seconds, 3),
                    "passed": passed,
                }
            )
        )
    else:
        verdict = "" if passed is None else ("  matches" if passed else f"  DIFFERS from {args.expect}")
        print(f"{node} {result.device} fingerprint {result.fingerprint}{verdict}")
    return EXIT_MISMATCH if passed is False else 0
