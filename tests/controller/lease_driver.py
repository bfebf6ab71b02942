"""One controller process for the two-controller test: ``lease_driver.py DB LOG [GATE]``. Runs
passes until the incident is resumed or another controller holds the lease; every backend call
that changes the cluster is appended to LOG (O_APPEND, one line per call) before it is made.
With GATE, it writes ``GATE.<pid>`` once imported and set up, and opens the controller only when
GATE exists: the test starts both controllers together, however slowly each process starts."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from replicheck.controller import Controller, ControllerConfig, LocalBackend, State
from replicheck.controller.errors import LeaseHeldError
from replicheck.incident import Incident, NodeIdentity, Suspect

CHANGES = ("cordon", "uncordon", "replace", "resume")


class Logged:
    def __init__(self, inner: LocalBackend, log: str) -> None:
        self.inner, self.log, self.name = inner, log, inner.name

    def __getattr__(self, method: str) -> Any:
        target = getattr(self.inner, method)

        def call(*args: Any, **kwargs: Any) -> Any:
            if method in CHANGES:
                fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                os.write(fd, f"{os.getpid()} {method} {args[0] if method != 'resume' else 'job'}\n".encode())
                os.close(fd)
            return target(*args, **kwargs)

        return call


def main() -> int:
    db, log = sys.argv[1], sys.argv[2]
    local = LocalBackend(db)
    local.add_job("job9", ("n1", "n2", "n3"))
    inc = Incident(
        id="job9-s5-replay",
        job_id="job9",
        step=5,
        check="replay",
        suspect_ranks=(1,),
        suspect_nodes=("n2",),
        classification="persistent",
        suspects=(Suspect(1, NodeIdentity(name="n2")),),
        world_size=4,
        recommended_checkpoint={"step": 4, "path": "/ck/4"},
    )
    config = ControllerConfig(apply=True, auto_approve=True, return_poll_s=0, checkpoint_roots=("/ck",))
    if len(sys.argv) > 3:
        gate = Path(sys.argv[3])
        Path(f"{gate}.{os.getpid()}").touch()
        deadline = time.monotonic() + 60
        while not gate.exists():
            if time.monotonic() > deadline:
                print("unfinished: the gate never opened")
                return 1
            time.sleep(0.001)
    with Controller(db, backend=Logged(local, log), config=config) as ctl:  # type: ignore[arg-type]
        ctl.ingest(inc, vouched_by="job token job9 (jobs=job9)")
        try:
            for _ in range(30):
                ctl.reconcile()
                if ctl.store.get_record(inc.id).state is State.RESUMED:
                    print("acted")
                    return 0
        except LeaseHeldError as exc:
            print(f"refused: {exc}")
            return 0
    print("unfinished")
    return 1


if __name__ == "__main__":
    sys.exit(main())
