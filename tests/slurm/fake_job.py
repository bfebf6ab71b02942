"""A stand-in for a guarded training task under ``srun`` (torch-free): on its first run the
task on the faulty node reports an incident naming itself and every task exits with
EXIT_CORRUPTION; run with --resume-step it records where it resumed and exits 0."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from replicheck.codes import EXIT_CORRUPTION
from replicheck.incident import Incident, Suspect, make_incident_id, write_incident
from replicheck.runtime import RuntimeInfo


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--incident-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--resume-step", type=int, default=None)
    args = p.parse_args()
    info = RuntimeInfo.from_env()
    if args.resume_step is not None:
        Path(args.out, f"resumed-{args.rank}").write_text(f"{info.node.name} {args.resume_step}\n")
        return 0
    if args.rank == 1:
        step = 25
        incident = Incident(
            id=make_incident_id(info.job_id, step, "replay"), job_id=info.job_id, step=step, check="replay",
            suspect_ranks=(1,), suspect_nodes=(info.node.name,), classification="persistent",
            suspects=(Suspect(1, info.node),), recommended_checkpoint={"step": 20, "path": f"{args.out}/ck-20"},
            last_verified_step=20, world_size=2)
        write_incident(incident, args.incident_dir)
    return EXIT_CORRUPTION


if __name__ == "__main__":
    sys.exit(main())
