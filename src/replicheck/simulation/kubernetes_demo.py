"""Play the recovery story with the ``kubernetes`` backend against the simulated API server
(``replicheck.simulation.kubernetes``) and print every request the controller sends::

    python -m replicheck.simulation.kubernetes_demo [--db PATH] [--bodies]

An ambiguous incident names two nodes (ranks on n2 and n3 disagree): the controller checks
them against the nodes of the Job's pods (``job-name=llm``, on n1-n4), both are cordoned, the
pinned self-test finds n2 bad and n3 good (n3 is uncordoned), a person approves, n2 gets
HyperPod's ``UnschedulablePendingReplacement`` label, HyperPod (played by the script) swaps
it for n5, and the training Job is re-created from the recommended checkpoint.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from replicheck.controller.backends.kubernetes import KubernetesBackend, KubernetesConfig
from replicheck.controller.config import ControllerConfig
from replicheck.controller.controller import Controller
from replicheck.controller.model import State, Transition
from replicheck.incident import Incident, NodeIdentity, Suspect, make_incident_id
from replicheck.simulation.kubernetes import FakeApiServer, Request, make_node

TRAINING_JOB: dict[str, Any] = {
    "apiVersion": "batch/v1",
    "kind": "Job",
    "metadata": {"name": "llm", "labels": {"app": "llm"}},
    "spec": {
        "backoffLimit": 0,
        "template": {
            "metadata": {"labels": {"app": "llm"}},
            "spec": {"restartPolicy": "Never", "containers": [{"name": "train", "image": "trainer:1"}]},
        },
    },
}


def demo_incident() -> Incident:
    """Ranks 2 and 3 (on n2 and n3) disagree and a majority cannot say which is wrong."""
    ranks = tuple(
        Suspect(rank=r, node=NodeIdentity(name=n, hostname=n, k8s_node=n)) for r, n in ((2, "n2"), (3, "n3"))
    )
    return Incident(
        id=make_incident_id("ml/llm", 1200, "replay"),
        job_id="ml/llm",
        step=1200,
        check="replay",
        suspect_ranks=(),
        suspect_nodes=("n2", "n3"),
        classification="ambiguous",
        candidates=ranks,
        recommended_checkpoint={"step": 1000, "path": "/fsx/ckpt/step-1000"},
        world_size=8,
        last_verified_step=1000,
    )


def play(db: Path, *, show_bodies: bool = False, out: Any = None) -> dict[str, Any]:
    """Run the whole story, printing to ``out`` (default: stdout); returns a summary (final
    state, request counts, every request) for tests."""
    out = out if out is not None else sys.stdout

    def fingerprint(job: dict[str, Any]) -> tuple[bool, str]:
        node = job["metadata"]["annotations"]["replicheck.io/node"]
        return True, json.dumps({"node": node, "fingerprint": "9f1c" if node == "n2" else "4ab0"})

    now = [_dt.datetime.now(_dt.UTC)]

    def clock() -> _dt.datetime:
        return now[0]

    with FakeApiServer(job_runner=fingerprint, clock=clock) as server:
        for name in ("n1", "n2", "n3", "n4"):
            server.add_node(make_node(name, group="workers"))
        server.add_job("ml", TRAINING_JOB)
        for rank, name in enumerate(("n1", "n2", "n3", "n4")):
            # The Job's pods: the allocation the controller checks the incident's nodes against.
            server.add_pod("ml", f"llm-{rank}", name, labels={"job-name": "llm"})
        backend = KubernetesBackend(
            KubernetesConfig(host=server.url, resume_mode="recreate", triage_image="replicheck:demo"),
            clock=clock,
        )
        config = ControllerConfig(
            apply=True, return_poll_s=0, poll_interval_s=0, checkpoint_roots=("/fsx/ckpt",)
        )
        shown = 0

        def flush() -> None:
            nonlocal shown
            for req in server.requests[shown:]:
                print("    " + _describe(req, show_bodies), file=out)
            shown = len(server.requests)

        def said(t: Transition) -> None:
            flush()
            print(f"  {t.from_state.value} -> {t.to_state.value}: {t.reason}", file=out)

        with Controller(db, backend=backend, config=config, on_transition=said, clock=clock) as ctl:
            incident = demo_incident()
            print(
                f"incident {incident.id}: {incident.classification}, nodes {', '.join(incident.suspect_nodes)}",
                file=out,
            )
            ctl.ingest(incident)
            _settle(ctl, incident.id, flush)
            print("approve (alice)", file=out)
            ctl.approve(incident.id, by="alice")
            _settle(ctl, incident.id, flush)
            print("HyperPod replaces n2 with n5 (a minute later)", file=out)
            now[0] += _dt.timedelta(seconds=60)
            server.remove_node("n2")
            server.add_node(make_node("n5", group="workers"))
            _settle(ctl, incident.id, flush)
            state = ctl.store.get_record(incident.id).state
        counts: dict[str, int] = {}
        for req in server.requests:
            counts[req.method] = counts.get(req.method, 0) + 1
        print(f"final state: {state.value}; requests: {json.dumps(counts, sort_keys=True)}", file=out)
        return {
            "state": state.value,
            "requests": counts,
            "log": list(server.requests),
            "replace_patches": sum(
                1
                for r in server.requests
                if r.method == "PATCH" and "UnschedulablePendingReplacement" in json.dumps(r.body)
            ),
        }


def _settle(ctl: Controller, incident_id: str, flush: Any, rounds: int = 12) -> None:
    """Reconcile until the incident waits for a person, finished, or made no progress twice."""
    idle = 0
    for _ in range(rounds):
        before = ctl.store.get_record(incident_id)
        ctl.reconcile()
        flush()
        after = ctl.store.get_record(incident_id)
        if after.state in (State.AWAITING_APPROVAL, State.RESUMED, State.FAILED, State.UNCORDONED):
            return
        idle = idle + 1 if after == before else 0
        if idle >= 2:
            return


def _describe(req: Request, show_bodies: bool) -> str:
    query = "?" + "&".join(f"{k}={v}" for k, v in req.query.items()) if req.query else ""
    line = f"{req.method:6} {req.path}{query}"
    if req.content_type and req.method in ("PATCH", "POST"):
        line += f"  [{req.content_type}]"
    if req.body is not None and (show_bodies or req.method == "PATCH"):
        line += "  " + json.dumps(req.body, sort_keys=True)
    return line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m replicheck.simulation.kubernetes_demo",
        description="the recovery story against a local fake Kubernetes API server",
    )
    parser.add_argument("--db", help="controller database (default: a temporary file)")
    parser.add_argument("--bodies", action="store_true", help="also print POST/DELETE bodies (Jobs)")
    args = parser.parse_args(argv)
    if args.db:
        summary = play(Path(args.db), show_bodies=args.bodies)
    else:
        with tempfile.TemporaryDirectory(prefix="replicheck-kube-demo-") as tmp:
            summary = play(Path(tmp) / "ctl.db", show_bodies=args.bodies)
    return 0 if summary["state"] == State.RESUMED.value else 1


if __name__ == "__main__":
    raise SystemExit(main())
