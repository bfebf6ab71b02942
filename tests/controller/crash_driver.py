"""Runs the controller over a local cluster until the incident settles; optionally SIGKILLs
itself right after a chosen backend call or a chosen committed transition. Used by
test_crash.py as a subprocess: ``crash_driver.py DB [call:KIND | state:STATE]``."""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

from replicheck.controller import Controller, ControllerConfig, LocalBackend, State
from replicheck.incident import Incident, NodeIdentity, Suspect


def incident() -> Incident:
    cands = tuple(Suspect(rank=r, node=NodeIdentity(name=n)) for r, n in ((1, "n2"), (2, "n3")))
    return Incident(
        id="job7-s50-gradients",
        job_id="job7",
        step=50,
        check="gradients",
        suspect_ranks=(),
        suspect_nodes=("n2", "n3"),
        classification="ambiguous",
        candidates=cands,
        recommended_checkpoint={"step": 40, "path": "/ck/40"},
        world_size=4,
        time="2025-01-01T00:00:00+00:00",
    )


class KillAfter:
    """Delegates to the local backend and kills the process right after ``kind`` returns."""

    def __init__(self, inner: LocalBackend, kind: str) -> None:
        self.inner, self.kind, self.name = inner, kind, inner.name

    def __getattr__(self, method: str) -> Any:
        target = getattr(self.inner, method)

        def call(*args: Any, **kwargs: Any) -> Any:
            result = target(*args, **kwargs)
            if method == self.kind:
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        return call


def main() -> int:
    db, point = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "")
    local = LocalBackend(db)
    for name in ("n1", "n2", "n3", "n4"):
        local.add_node(name)
    local.add_node("s1", spare=True)
    local.set_healthy("n3", False)
    local.add_job("job7", ("n1", "n2", "n3", "n4"))
    backend: Any = KillAfter(local, point[5:]) if point.startswith("call:") else local

    def on_transition(t: Any) -> None:
        if point == f"state:{t.to_state.value}":
            os.kill(os.getpid(), signal.SIGKILL)

    ctl = Controller(
        db,
        backend=backend,
        config=ControllerConfig(apply=True, return_poll_s=0, checkpoint_roots=("/ck",)),
        on_transition=on_transition,
    )
    inc = incident()
    ctl.ingest(inc)
    for _ in range(20):
        ctl.reconcile()
        record = ctl.store.get_record(inc.id)
        if record.state is State.AWAITING_APPROVAL:
            ctl.approve(inc.id, by="ops")
        if record.state is State.RESUMED:
            break
    record = ctl.store.get_record(inc.id)
    summary = {
        "state": record.state.value,
        "targets": record.targets,
        "cordoned": record.cordoned,
        "triage": [(t.node, t.passed) for t in record.triage],
        "approved_by": record.approved_by,
        "replaced": record.replaced,
        "returned": record.returned,
        "nodes": [(n.name, n.state, n.reason, n.extra["role"]) for n in local.list_nodes()],
        "ops": local.op_counts(),
        "resumes": [(r.job_id, r.checkpoint, r.exclude, r.nodes) for r in local.resume_requests()],
    }
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
