"""The ``kubernetes`` backend with the official client against a local fake API server.

No real Kubernetes API server can run on the machines these tests run on, so the client
talks plain HTTP to the simulated one, ``replicheck.simulation.kubernetes.FakeApiServer``
(threaded, 127.0.0.1, port 0). The fake records every request; the tests check verbs, paths, content
types and patch bodies exactly, and make it answer the way the API server does (409 on a
stale resourceVersion, 404, 403, 5xx). API calls are counted to prove idempotency.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ctlkit import Clock, make_incident

from replicheck.controller import Controller, ControllerConfig, State
from replicheck.controller.backends.base import ResumeRequest
from replicheck.controller.backends.kubernetes import (
    HEALTH_LABEL,
    KubernetesBackend,
    KubernetesConfig,
)
from replicheck.controller.errors import ConfigError, NotYet, PermanentBackendError, TransientBackendError
from replicheck.simulation.kubernetes import MERGE_PATCH, FakeApiServer, make_node

pytestmark = pytest.mark.timeout(60)

NODE = "/api/v1/nodes/n2"
GOOD = '{"node": "x", "fingerprint": "aa11", "passed": null}\n'


@pytest.fixture
def server(clock: Clock) -> Iterator[FakeApiServer]:
    with FakeApiServer(clock=clock, job_runner=lambda job: (True, "warming up\n" + GOOD)) as srv:
        for name in ("n1", "n2", "n3"):
            srv.add_node(make_node(name, group="workers", internal_dns=f"ip-10-0-0-{name[1]}.ec2.internal"))
            # job1's ranks (the incidents' job) run on every node: the allocation check passes.
            srv.add_pod("default", f"job1-{name}", name, labels={"job-name": "job1"})
        yield srv


def backend(server: FakeApiServer, clock: Clock | None = None, **config: Any) -> KubernetesBackend:
    return KubernetesBackend(
        KubernetesConfig(host=server.url, request_timeout_s=5, **config), clock=clock or server.clock
    )


def patches(server: FakeApiServer, path: str = NODE) -> list[Any]:
    return [r.body for r in server.requests if r.method == "PATCH" and r.path == path]


# --- cordon / uncordon ------------------------------------------------------------------------


def test_cordon_sends_one_conditional_merge_patch(server: FakeApiServer, clock: Clock) -> None:
    """Cordon is one merge patch: unschedulable, our NoSchedule taint, label and who/why/when annotations, resourceVersion."""
    rv = server.node("n2")["metadata"]["resourceVersion"]
    backend(server, clock).cordon("n2", "replicheck: suspected", "job1-s40-replay:cordon:n2")
    (req,) = [r for r in server.requests if r.method == "PATCH"]
    assert (req.path, req.content_type) == (NODE, MERGE_PATCH)
    assert req.body == {
        "metadata": {
            "resourceVersion": rv,
            "labels": {"replicheck.io/cordoned": "true"},
            "annotations": {
                "replicheck.io/cordoned-by": "replicheck-controller",
                "replicheck.io/incident": "job1-s40-replay",
                "replicheck.io/cordoned-at": "2025-01-01T00:00:00.000000+00:00",
                "replicheck.io/reason": "replicheck: suspected",
                "replicheck.io/cordon-added": "taint,unschedulable",
            },
        },
        "spec": {
            "taints": [{"key": "replicheck.io/suspect", "value": "true", "effect": "NoSchedule"}],
            "unschedulable": True,
        },
    }
    assert server.node("n2")["spec"]["unschedulable"] is True


def test_cordon_twice_patches_once(server: FakeApiServer) -> None:
    """A repeated cordon (e.g. after a crash) reads the node and sends no second patch."""
    b = backend(server)
    b.cordon("n2", "r", "i:cordon:n2")
    second = b.cordon("n2", "r", "i:cordon:n2")
    assert len(patches(server)) == 1 and "already cordoned" in second["detail"]


def test_uncordon_reverses_only_what_we_added(server: FakeApiServer) -> None:
    """On a node someone else cordoned (and tainted), uncordon removes our taint and marks and leaves theirs."""
    theirs = {"key": "ops/maintenance", "value": "disk", "effect": "NoSchedule"}
    server.edit_node("n2", lambda n: n["spec"].update(unschedulable=True, taints=[theirs]))
    b = backend(server)
    b.cordon("n2", "r", "i:cordon:n2")
    assert patches(server)[0]["metadata"]["annotations"]["replicheck.io/cordon-added"] == "taint"
    assert "unschedulable" not in patches(server)[0]["spec"]
    b.uncordon("n2", "r", "i:uncordon:n2")
    undo = patches(server)[1]
    assert undo["spec"] == {"taints": [theirs]}
    assert undo["metadata"]["labels"] == {"replicheck.io/cordoned": None}
    assert set(undo["metadata"]["annotations"].values()) == {None}
    node = server.node("n2")
    assert node["spec"] == {"unschedulable": True, "taints": [theirs]}
    assert not any(
        k.startswith("replicheck.io/")
        for k in {**node["metadata"]["labels"], **node["metadata"]["annotations"]}
    )


def test_uncordon_of_our_cordon_restores_node(server: FakeApiServer) -> None:
    """Uncordoning our own cordon makes the node schedulable again with no replicheck marks."""
    before = server.node("n2")
    b = backend(server)
    b.cordon("n2", "r", "i:cordon:n2")
    b.uncordon("n2", "r", "i:uncordon:n2")
    after = server.node("n2")
    assert after["metadata"]["labels"] == before["metadata"]["labels"]
    assert after["metadata"]["annotations"] == {} and after["spec"].get("taints") == []
    assert "unschedulable" not in after["spec"]


def test_uncordon_leaves_node_not_cordoned_by_us(server: FakeApiServer) -> None:
    """A node cordoned by someone else (kubectl cordon) is not patched by uncordon."""
    server.edit_node("n2", lambda n: n["spec"].update(unschedulable=True))
    result = backend(server).uncordon("n2", "r", "i:uncordon:n2")
    assert patches(server) == [] and "not cordoned by replicheck" in result["detail"]
    assert server.node("n2")["spec"]["unschedulable"] is True


def test_conflict_is_reread_and_retried(server: FakeApiServer) -> None:
    """A concurrent writer between read and patch yields 409; the backend re-reads and keeps both changes."""
    other = lambda: server.edit_node("n2", lambda n: n["metadata"]["labels"].update(team="a"))  # noqa: E731
    server.fail("PATCH", NODE, status=0, before=other)  # change the node, then let the stale patch through
    backend(server).cordon("n2", "r", "i:cordon:n2")
    assert server.count("GET", NODE) == 2 and server.count("PATCH", NODE) == 2
    first, second = patches(server)
    assert first["metadata"]["resourceVersion"] != second["metadata"]["resourceVersion"]
    labels = server.node("n2")["metadata"]["labels"]
    assert labels["team"] == "a" and labels["replicheck.io/cordoned"] == "true"


def test_endless_conflicts_are_temporary(server: FakeApiServer) -> None:
    """When every patch conflicts, the backend gives up after conflict_retries with a temporary error."""
    server.fail("PATCH", NODE, status=409, times=10)
    with pytest.raises(TransientBackendError, match="still conflicting"):
        backend(server, conflict_retries=3).cordon("n2", "r", "i:cordon:n2")
    assert server.count("PATCH", NODE) == 3


@pytest.mark.parametrize(
    "status,error",
    [
        (403, PermanentBackendError),
        (401, PermanentBackendError),
        (422, PermanentBackendError),
        (500, TransientBackendError),
        (503, TransientBackendError),
        (429, TransientBackendError),
    ],
)
def test_api_errors_map_to_permanent_or_temporary(server: FakeApiServer, status: int, error: type) -> None:
    """An API error status on the node read becomes the matching permanent or temporary error."""
    server.fail("GET", NODE, status=status)
    with pytest.raises(error) as info:
        backend(server).cordon("n2", "r", "i:cordon:n2")
    assert not isinstance(info.value, TransientBackendError) or error is TransientBackendError
    if status == 403:
        assert "RBAC" in str(info.value)


def test_unreachable_api_server_is_temporary(server: FakeApiServer) -> None:
    """A connection refused (server gone) is a temporary error, not a crash."""
    b = backend(server)
    server.stop()
    with pytest.raises(TransientBackendError, match="unreachable"):
        b.cordon("n2", "r", "i:cordon:n2")


# --- node names -------------------------------------------------------------------------------


def test_unknown_node_is_permanent(server: FakeApiServer) -> None:
    """A name that is no node, host name or pod is a permanent error (404 on read, no match in lists)."""
    with pytest.raises(PermanentBackendError, match="no Kubernetes node matches"):
        backend(server).cordon("ghost", "r", "i:cordon:ghost")
    assert patches(server, "/api/v1/nodes/ghost") == []


@pytest.mark.parametrize("alias", ["ip-10-0-0-2.ec2.internal", "ip-10-0-0-2"])
def test_dns_name_maps_to_node(server: FakeApiServer, alias: str) -> None:
    """The incident's host name (InternalDNS address, or its first label) maps to the Kubernetes node."""
    backend(server).cordon(alias, "r", f"i:cordon:{alias}")
    assert len(patches(server)) == 1


def test_pod_name_maps_to_its_node(server: FakeApiServer) -> None:
    """A rank's host name inside a pod is the pod name; it maps to the pod's spec.nodeName."""
    server.add_pod("training", "trainer-worker-1", "n2")
    backend(server).cordon("trainer-worker-1", "r", "i:cordon:trainer-worker-1")
    assert len(patches(server)) == 1
    lookup = [r for r in server.requests if r.path == "/api/v1/pods"]
    assert lookup[0].query == {"fieldSelector": "metadata.name=trainer-worker-1"}


def test_invalid_names_never_reach_the_api(server: FakeApiServer) -> None:
    """Names with path or selector characters are refused before any request."""
    with pytest.raises(PermanentBackendError, match="invalid node name"):
        backend(server).cordon("../nodes", "r", "k")
    assert server.requests == []


# --- replacement ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "remediation,where,key,value",
    [
        ("hyperpod-replace", "labels", HEALTH_LABEL, "UnschedulablePendingReplacement"),
        ("hyperpod-reboot", "labels", HEALTH_LABEL, "UnschedulablePendingReboot"),
        ("label", "labels", "remediate.example.com/action", "replace"),
        ("annotation", "annotations", "remediate.example.com/action", "replace"),
    ],
)
def test_replace_sets_remediation_mark_once(
    server: FakeApiServer, remediation: str, where: str, key: str, value: str
) -> None:
    """Replace writes the configured label/annotation once; a repeated call sends no second patch."""
    b = backend(server, remediation=remediation, remediation_key="remediate.example.com/action")
    b.replace("n2", "i:replace:n2")
    b.replace("n2", "i:replace:n2")
    (body,) = patches(server)
    assert body["metadata"][where][key] == value
    assert server.node("n2")["metadata"][where][key] == value


def test_replace_none_changes_nothing(server: FakeApiServer) -> None:
    """remediation=none leaves the node cordoned for a person and sends no request."""
    b = backend(server, remediation="none")
    assert "stays cordoned" in b.replace("n2", "i:replace:n2")["detail"]
    assert b.await_return("n2", "i:await_return:n2")["back"] is False
    assert server.requests == []


def test_await_return_waits_for_hyperpod(server: FakeApiServer, clock: Clock) -> None:
    """Pending health label: NotYet; old node removed: NotYet until a new Ready node of its group joins, which is the replacement."""
    b = backend(server, clock)
    b.replace("n2", "i:replace:n2")
    with pytest.raises(NotYet, match="UnschedulablePendingReplacement"):
        b.await_return("n2", "i:await_return:n2")
    server.remove_node("n2")
    with pytest.raises(NotYet, match="waiting for its replacement to join workers"):
        b.await_return("n2", "i:await_return:n2")
    clock.advance(120)
    server.add_node(make_node("n9", group="other"))
    server.add_node(make_node("n7", group="workers"))
    result = b.await_return("n2", "i:await_return:n2")
    assert (result["back"], result["replacement"]) == (False, "n7")


def test_restarted_controller_learns_the_request_from_the_node(server: FakeApiServer, clock: Clock) -> None:
    """A fresh backend reads the request time from the node's annotation and still finds the replacement."""
    backend(server, clock).replace("n2", "i:replace:n2")
    restarted = backend(server, clock)
    with pytest.raises(NotYet):
        restarted.await_return("n2", "i:await_return:n2")
    server.remove_node("n2")
    clock.advance(60)
    server.add_node(make_node("n7", group="workers"))
    assert restarted.await_return("n2", "i:await_return:n2")["replacement"] == "n7"


def test_node_gone_before_restart_is_not_back(server: FakeApiServer) -> None:
    """If the old node vanished while no controller watched, it is reported not back (excluded), without waiting."""
    backend(server).replace("n2", "i:replace:n2")
    server.remove_node("n2")
    result = backend(server).await_return("n2", "i:await_return:n2")
    assert (result["back"], result["replacement"]) == (False, None)


def test_rebooted_node_comes_back_and_our_cordon_is_lifted(server: FakeApiServer) -> None:
    """After a reboot HyperPod resets the label to Schedulable: the node is back and our cordon is removed."""
    b = backend(server, remediation="hyperpod-reboot")
    b.cordon("n2", "r", "i:cordon:n2")
    b.replace("n2", "i:replace:n2")
    server.edit_node("n2", lambda n: n["metadata"]["labels"].update({HEALTH_LABEL: "Schedulable"}))
    assert b.await_return("n2", "i:await_return:n2")["back"] is True
    node = server.node("n2")
    assert "unschedulable" not in node["spec"] and node["spec"]["taints"] == []
    assert not any(k.startswith("replicheck.io/") for k in node["metadata"]["annotations"])


def test_nodes_pending_replacement_are_not_schedulable(server: FakeApiServer) -> None:
    """list_nodes and the last-node rule count neither our cordon nor HyperPod's Unschedulable* label as schedulable."""
    b = backend(server)
    b.cordon("n1", "r", "i:cordon:n1")
    server.edit_node(
        "n3", lambda n: n["metadata"]["labels"].update({HEALTH_LABEL: "UnschedulablePendingReboot"})
    )
    assert b.schedulable_by_partition("n2") == {"workers": ["n2"]}
    infos = {i.name: i for i in b.list_nodes()}
    assert infos["n1"].extra["cordoned_by_us"] and infos["n1"].state == "Ready,SchedulingDisabled"


# --- triage -----------------------------------------------------------------------------------


def test_selftest_job_is_pinned_tolerates_cordon_and_is_cleaned_up(
    server: FakeApiServer, clock: Clock
) -> None:
    """Triage creates two Jobs pinned to suspect and reference, polls them, compares fingerprints, deletes both."""
    b = backend(server, clock)
    b.cordon("n2", "r", "i:cordon:n2")
    with pytest.raises(NotYet):
        b.selftest("n2", "i:selftest:n2")
    posts = [r for r in server.requests if r.method == "POST"]
    assert [p.path for p in posts] == ["/apis/batch/v1/namespaces/replicheck/jobs"] * 2
    assert {p.content_type for p in posts} == {"application/json"}
    job = posts[0].body
    pod = job["spec"]["template"]["spec"]
    assert job["spec"]["backoffLimit"] == 0 and job["spec"]["activeDeadlineSeconds"] == 600
    assert pod["nodeSelector"] == {"kubernetes.io/hostname": "n2"}
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert terms == [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n2"]}]}]
    assert {(t["key"], t["effect"]) for t in pod["tolerations"]} == {
        ("replicheck.io/suspect", "NoSchedule"),
        ("node.kubernetes.io/unschedulable", "NoSchedule"),
    }
    assert pod["containers"][0]["command"][-2:] == ["--node", "n2"]
    assert pod["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": "1"}}
    assert posts[1].body["spec"]["template"]["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "n1"}
    with pytest.raises(NotYet):
        b.selftest("n2", "i:selftest:n2")
    result = b.selftest("n2", "i:selftest:n2")
    assert result["passed"] is True and result["reference"] == "n1"
    assert server.count("POST") == 2 and server.count("DELETE") == 2 and server.cluster.jobs == {}


def test_selftest_mismatch_fails_the_suspect(server: FakeApiServer) -> None:
    """Different fingerprints on suspect and reference make the triage result passed=False."""
    server.job_polls_until_done = 0
    server.job_runner = lambda job: (
        True,
        '{"fingerprint": "%s"}'
        % ("bad" if job["metadata"]["annotations"]["replicheck.io/node"] == "n2" else "good"),
    )
    b = backend(server)
    with pytest.raises(NotYet):
        b.selftest("n2", "i:selftest:n2")
    result = b.selftest("n2", "i:selftest:n2")
    assert result["passed"] is False and "differs" in result["detail"]


def test_selftest_without_result_is_permanent_and_cleaned(server: FakeApiServer) -> None:
    """A self-test pod that prints no fingerprint is a permanent error, and its Jobs are deleted."""
    server.job_polls_until_done = 0
    server.job_runner = lambda job: (False, "CUDA error: an illegal memory access")
    b = backend(server)
    with pytest.raises(NotYet):
        b.selftest("n2", "i:selftest:n2")
    with pytest.raises(PermanentBackendError, match="illegal memory access"):
        b.selftest("n2", "i:selftest:n2")
    assert server.cluster.jobs == {}


def test_selftest_restart_reuses_the_running_job(server: FakeApiServer) -> None:
    """A controller restarted while the Jobs run (new backend object) creates no second Job."""
    server.job_polls_until_done = 3
    with pytest.raises(NotYet):
        backend(server).selftest("n2", "i:selftest:n2")
    with pytest.raises(NotYet):
        backend(server).selftest("n2", "i:selftest:n2")
    assert server.count("POST") == 2


def test_selftest_job_lost_past_deadline_is_permanent(server: FakeApiServer, clock: Clock) -> None:
    """A Job that never finishes is given up after activeDeadlineSeconds plus grace, and deleted."""
    server.job_polls_until_done = 10**6
    b = backend(server, clock, triage_timeout_s=60)
    with pytest.raises(NotYet):
        b.selftest("n2", "i:selftest:n2")
    clock.advance(60 + 121)
    with pytest.raises(PermanentBackendError, match="no result within 60s"):
        b.selftest("n2", "i:selftest:n2")
    assert server.cluster.jobs == {}


# --- resume -----------------------------------------------------------------------------------


TRAINING_JOB = {
    "apiVersion": "batch/v1",
    "kind": "Job",
    "metadata": {"name": "llm", "labels": {"team": "a", "controller-uid": "u1"}},
    "spec": {
        "selector": {"matchLabels": {"controller-uid": "u1"}},
        "backoffLimit": 3,
        "template": {
            "metadata": {"labels": {"controller-uid": "u1", "job-name": "llm", "app": "llm"}},
            "spec": {
                "restartPolicy": "Never",
                "containers": [
                    {
                        "name": "train",
                        "image": "trainer",
                        "env": [
                            {"name": "REPLICHECK_RESUME_STEP", "value": "old"},
                            {"name": "A", "value": "1"},
                        ],
                    }
                ],
            },
        },
    },
}


def test_recreate_resume_copies_job_with_checkpoint_once(server: FakeApiServer) -> None:
    """resume_mode=recreate creates one copy of the Job without server-set selector labels, with the checkpoint in env."""
    server.add_job("ml", TRAINING_JOB)
    b = backend(server, resume_mode="recreate")
    request = ResumeRequest("inc", "ml/llm", {"step": 30, "path": "/ck/30"}, ("n2",))
    first = b.resume(request, "inc:resume:ml/llm")
    again = b.resume(request, "inc:resume:ml/llm")
    (post,) = [r for r in server.requests if r.method == "POST"]
    assert post.path == "/apis/batch/v1/namespaces/ml/jobs" and "already" in again["detail"]
    job = post.body
    assert job["metadata"]["name"] == first["job_id"].split("/")[1] and job["metadata"]["labels"] == {
        "team": "a"
    }
    assert "selector" not in job["spec"] and job["spec"]["template"]["metadata"]["labels"] == {"app": "llm"}
    env = job["spec"]["template"]["spec"]["containers"][0]["env"]
    assert env == [
        {"name": "A", "value": "1"},
        {"name": "REPLICHECK_RESUME_STEP", "value": "30"},
        {"name": "REPLICHECK_RESUME_CHECKPOINT", "value": "/ck/30"},
    ]


def test_recreate_resume_of_unknown_job_is_permanent(server: FakeApiServer) -> None:
    """Resuming a Job that does not exist is a permanent error naming the fix."""
    with pytest.raises(PermanentBackendError, match="not found"):
        backend(server, resume_mode="recreate").resume(ResumeRequest("i", "nope", None, ()), "i:resume:nope")


def test_join_copies_the_departed_groups_job_once(server: FakeApiServer) -> None:
    """join_mode=copy starts one replacement replica group: a copy of the departed group's Job
    without the server-set selector and controller labels, with REPLICA_GROUP_ID set in every
    container and the group and join labels; a repeat with the same key sends no second POST,
    and the departed Job itself is never modified."""
    from replicheck.controller.backends.base import JoinRequest

    server.add_job("ml", TRAINING_JOB)
    b = backend(server, join_mode="copy")
    request = JoinRequest("inc-s30-replay", "ml/llm", "group1", (), ("n2",))
    first = b.join(request, "inc-s30-replay:join_replacement:ml/llm")
    again = b.join(request, "inc-s30-replay:join_replacement:ml/llm")
    (post,) = [r for r in server.requests if r.method == "POST"]
    assert [r for r in server.requests if r.method in ("PUT", "PATCH", "DELETE")] == []
    assert post.path == "/apis/batch/v1/namespaces/ml/jobs" and again["detail"].startswith("already started")
    job = post.body
    assert job["metadata"]["name"] == first["job_id"].split("/")[1] and "-join-" in job["metadata"]["name"]
    assert job["metadata"]["labels"]["team"] == "a"
    assert job["metadata"]["labels"]["replicheck.io/replica-group"] == "group1"
    assert job["metadata"]["annotations"]["replicheck.io/joins-for"] == "llm"
    assert "selector" not in job["spec"]
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert labels["app"] == "llm" and "controller-uid" not in labels and "job-name" not in labels
    assert labels["replicheck.io/replica-group"] == "group1"
    env = job["spec"]["template"]["spec"]["containers"][0]["env"]
    assert env[-1] == {"name": "REPLICA_GROUP_ID", "value": "group1"} and {"name": "A", "value": "1"} in env


def test_join_refuses_bad_values_and_a_missing_job(server: FakeApiServer) -> None:
    """An option-like replica group never reaches a request; a departed Job that is gone is a
    permanent error saying to start the group by hand; join_mode=none (the default) refuses with
    the typed not-built error."""
    from replicheck.controller.backends.base import JoinRequest
    from replicheck.controller.errors import JoinNotBuiltError

    b = backend(server, join_mode="copy")
    with pytest.raises(PermanentBackendError, match="replica group"):
        b.join(JoinRequest("inc", "ml/llm", "-x", (), ()), "inc:join_replacement:ml/llm")
    assert server.requests == []
    with pytest.raises(PermanentBackendError, match="by hand"):
        b.join(JoinRequest("inc", "ml/gone", "group1", (), ()), "inc:join_replacement:ml/gone")
    with pytest.raises(JoinNotBuiltError, match="join_mode=none"):
        backend(server).join(JoinRequest("inc", "ml/llm", "group1", (), ()), "k")


def test_job_restart_resume_sends_nothing(server: FakeApiServer) -> None:
    """resume_mode=job-restart (default) leaves the restart to the Job's own policy: no request."""
    result = backend(server).resume(ResumeRequest("i", "llm", None, ("n2",)), "i:resume:llm")
    assert "restart policy" in result["detail"] and server.requests == []


# --- with the controller ----------------------------------------------------------------------


class Killed(BaseException):
    """Stands for the controller process dying right after a backend call returned."""


class DiesAfter:
    """Delegates to a backend; raises Killed right after the first call of ``method`` returns."""

    def __init__(self, inner: KubernetesBackend, method: str) -> None:
        self.inner, self.method, self.name = inner, method, inner.name

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.inner, name)
        if name != self.method:
            return fn

        def call(*args: Any) -> Any:
            fn(*args)
            raise Killed(name)

        return call


def health_patches(server: FakeApiServer) -> int:
    return sum(1 for b in patches(server) if HEALTH_LABEL in (b.get("metadata", {}).get("labels") or {}))


def test_controller_plays_the_story_and_never_replaces_twice(
    server: FakeApiServer, clock: Clock, tmp_path: Path
) -> None:
    """detect, cordon, approve, replace (controller killed after the patch, restarted), await, resume: one health-label patch."""
    db = tmp_path / "ctl.db"
    config = ControllerConfig(apply=True, checkpoint_roots=("/ck",), return_poll_s=5)
    inc = make_incident(nodes=("n2",))
    ctl = Controller(db, backend=DiesAfter(backend(server, clock), "replace"), config=config, clock=clock)
    ctl.ingest(inc, vouched_by="job token job1 (jobs=job1)")
    assert [t.to_state for t in ctl.reconcile()] == [State.CORDONED, State.AWAITING_APPROVAL]
    ctl.approve(inc.id, by="alice")
    with pytest.raises(Killed):
        ctl.reconcile()
    ctl.close()
    assert health_patches(server) == 1
    ctl = Controller(db, backend=backend(server, clock), config=config, clock=clock)
    ctl.reconcile()
    assert ctl.store.get_record(inc.id).state is State.REPLACING
    assert health_patches(server) == 1
    (replace,) = [a for a in ctl.store.actions(inc.id) if a.kind.value == "replace"]
    assert replace.status == "done" and "already requested" in str(replace.result)
    server.remove_node("n2")  # HyperPod terminates the instance; a new node joins under a new name
    clock.advance(10)
    server.add_node(make_node("n4", group="workers"))
    assert [t.to_state for t in ctl.reconcile()] == [State.REPLACED, State.RESUMED]
    assert ctl.store.get_record(inc.id).returned == (("n2", False, "n4"),)
    assert health_patches(server) == 1 and server.count("PATCH") == 2
    assert ctl.reconcile() == [] and server.count("PATCH") == 2
    ctl.close()


def test_dry_run_sends_no_write(server: FakeApiServer, clock: Clock, tmp_path: Path) -> None:
    """With the default dry-run, the controller reads the cluster but sends no PATCH, POST or DELETE."""
    ctl = Controller(
        tmp_path / "c.db",
        backend=backend(server, clock),
        config=ControllerConfig(auto_approve=True),
        clock=clock,
    )
    ctl.ingest(make_incident(nodes=("n2",)), vouched_by="job token job1 (jobs=job1)")
    ctl.reconcile()
    assert [r.method for r in server.requests if r.method != "GET"] == []
    ctl.close()


def test_last_schedulable_node_is_not_cordoned(server: FakeApiServer, clock: Clock, tmp_path: Path) -> None:
    """The only schedulable node of its group is left alone (the reason is recorded), no patch sent."""
    for other in ("n1", "n3"):
        server.edit_node(other, lambda n: n["spec"].update(unschedulable=True))
    ctl = Controller(
        tmp_path / "c.db",
        backend=backend(server, clock),
        config=ControllerConfig(apply=True, checkpoint_roots=("/ck",)),
        clock=clock,
    )
    inc = make_incident(nodes=("n2",))
    ctl.ingest(inc, vouched_by="job token job1 (jobs=job1)")
    ctl.reconcile()
    assert patches(server) == []
    assert "last schedulable node" in str(ctl.store.get_record(inc.id).cordon_skipped)
    ctl.close()


def test_last_node_rule_sees_through_host_names(server: FakeApiServer, clock: Clock, tmp_path: Path) -> None:
    """An incident naming the last schedulable node by its DNS host name is not cordoned either."""
    for other in ("n1", "n3"):
        server.edit_node(other, lambda n: n["spec"].update(unschedulable=True))
    assert backend(server).schedulable_by_partition("ip-10-0-0-2") == {"workers": ["ip-10-0-0-2"]}
    ctl = Controller(
        tmp_path / "c.db",
        backend=backend(server, clock),
        config=ControllerConfig(apply=True, checkpoint_roots=("/ck",)),
        clock=clock,
    )
    ctl.ingest(make_incident(nodes=("ip-10-0-0-2",)), vouched_by="job token job1 (jobs=job1)")
    ctl.reconcile()
    assert patches(server) == []
    ctl.close()


def test_blast_radius_allows_one_replacement(server: FakeApiServer, clock: Clock, tmp_path: Path) -> None:
    """With max_replacements=1, two approved incidents lead to one health-label patch; the second waits."""
    ctl = Controller(
        tmp_path / "c.db",
        backend=backend(server, clock),
        config=ControllerConfig(apply=True, checkpoint_roots=("/ck",), auto_approve=True, max_replacements=1),
        clock=clock,
    )
    ctl.ingest(make_incident(nodes=("n2",), step=40), vouched_by="job token job1 (jobs=job1)")
    ctl.ingest(make_incident(nodes=("n3",), step=50), vouched_by="job token job1 (jobs=job1)")
    ctl.reconcile()
    assert health_patches(server) == 1
    ctl.close()


# --- configuration ----------------------------------------------------------------------------


def test_config_is_loaded_from_toml_and_validated(server: FakeApiServer, tmp_path: Path) -> None:
    """[kubernetes] in the TOML builds the backend; unknown keys and bad values are ConfigErrors."""
    from replicheck.controller.wiring import load_settings, make_backend

    path = tmp_path / "c.toml"
    path.write_text(
        f'[controller]\nbackend = "kubernetes"\n[kubernetes]\nhost = "{server.url}"\n'
        'remediation = "hyperpod-reboot"\ntriage_command = ["replicheck", "selftest", "--json"]\n'
    )
    made = make_backend(load_settings(path), tmp_path / "c.db")
    assert isinstance(made, KubernetesBackend) and made.config.remediation == "hyperpod-reboot"
    assert [n.name for n in made.list_nodes()] == ["n1", "n2", "n3"]
    path.write_text('[kubernetes]\ncolour = "blue"\n')
    with pytest.raises(ConfigError, match="colour"):
        make_backend(load_settings(path, backend="kubernetes"), tmp_path / "c.db")
    with pytest.raises(ConfigError, match="remediation"):
        KubernetesConfig(remediation="reimage")


def test_missing_client_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the kubernetes package the error (an ImportError and a ConfigError) says which extra to install."""
    monkeypatch.setitem(sys.modules, "kubernetes", None)
    with pytest.raises(ImportError, match=r"replicheck\[kubernetes\]") as info:
        KubernetesBackend(KubernetesConfig(host="http://127.0.0.1:9"))
    assert isinstance(info.value, ConfigError)


def test_cli_reports_a_missing_client_in_one_line(tmp_path: Path) -> None:
    """``controller run`` with the kubernetes backend but no client installed exits 2 with one line naming the extra."""
    import subprocess

    config = tmp_path / "c.toml"
    config.write_text('[controller]\nbackend = "kubernetes"\n')
    code = (
        "import sys; sys.modules['kubernetes'] = None\n"
        "from replicheck.cli import main\n"
        f"sys.exit(main(['controller', 'run', '--db', {str(tmp_path / 'c.db')!r}, '--config', {str(config)!r}, '--once']))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stderr.strip().count("\n") == 0
    assert "pip install 'replicheck[kubernetes]'" in run.stderr


def test_demo_plays_the_story_against_the_fake_server(tmp_path: Path) -> None:
    """The documented Kubernetes demo command runs to resumed, replacing n2 exactly once and printing the requests."""
    import io

    from replicheck.simulation import kubernetes_demo

    out = io.StringIO()
    summary = kubernetes_demo.play(tmp_path / "demo.db", out=out)
    assert summary["state"] == "resumed" and summary["replace_patches"] == 1
    text = out.getvalue()
    assert "triaging -> awaiting_approval" in text and "n2 FAILED self-test" in text
    assert "PATCH  /api/v1/nodes/n2  [application/merge-patch+json]" in text
    assert "POST   /apis/batch/v1/namespaces/ml/jobs" in text


def test_demo_command_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m replicheck.simulation.kubernetes_demo`` (its main) succeeds and ends with the final state line."""
    from replicheck.simulation import kubernetes_demo

    assert kubernetes_demo.main([]) == 0
    assert "final state: resumed" in capsys.readouterr().out


def test_cli_runs_the_kubernetes_backend_from_the_config_file(server: FakeApiServer, tmp_path: Path) -> None:
    """``replicheck controller run --config`` with backend = "kubernetes" cordons through the API."""
    from replicheck.cli import main
    from replicheck.incident import write_incident

    config = tmp_path / "c.toml"
    config.write_text(f'[controller]\nbackend = "kubernetes"\n[kubernetes]\nhost = "{server.url}"\n')
    incident = write_incident(make_incident(nodes=("n2",)), tmp_path / "incidents")
    db = str(tmp_path / "c.db")
    assert (
        main(
            [
                "controller",
                "run",
                "--db",
                db,
                "--config",
                str(config),
                "--incident",
                str(incident),
                "--once",
                "--apply",
            ]
        )
        == 0
    )
    assert server.node("n2")["spec"]["unschedulable"] is True


DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _rbac_allows(
    docs: list[dict[str, Any]], namespace: str | None, group: str, resource: str, verb: str
) -> bool:
    for doc in docs:
        scoped = doc["kind"] == "Role"
        if doc["kind"] not in ("Role", "ClusterRole") or (
            scoped and doc["metadata"]["namespace"] != namespace
        ):
            continue
        for rule in doc["rules"]:
            if group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]:
                return True
    return False


def test_deploy_rbac_covers_every_request_the_demo_makes(tmp_path: Path) -> None:
    """Every request of the demo story outside the training namespace is allowed by deploy/rbac.yaml, and nothing more is granted."""
    import io
    import re

    import yaml

    from replicheck.simulation import kubernetes_demo

    docs = [d for d in yaml.safe_load_all((DEPLOY / "rbac.yaml").read_text()) if d]
    seen = kubernetes_demo.play(tmp_path / "d.db", out=io.StringIO())["log"]
    verbs = {"GET": "get", "PATCH": "patch", "POST": "create", "DELETE": "delete"}
    needed = set()
    for req in seen:
        m = re.fullmatch(
            r"/apis?/(?:(batch)/)?v1/(?:namespaces/([^/]+)/)?([a-z]+)(?:/([^/]+))?(/log)?", req.path
        )
        assert m, req.path
        group, ns, resource, name, log = m.groups()
        if ns == "ml":
            continue  # the training namespace: the optional resume Role, commented out by default
        verb = "list" if req.method == "GET" and name is None else verbs[req.method]
        needed.add((ns, group or "", resource + ("/log" if log else ""), verb))
    for ns, group, resource, verb in sorted(needed, key=str):
        assert _rbac_allows(docs, ns, group, resource, verb), (ns, group, resource, verb)
    granted = {
        (d["metadata"].get("namespace"), g, r, v)
        for d in docs
        if d["kind"] in ("Role", "ClusterRole")
        for rule in d["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    assert len(granted) == len(needed)


def test_deploy_config_is_a_valid_controller_config(tmp_path: Path) -> None:
    """The config.toml in deploy/controller.yaml loads and builds a kubernetes backend configuration."""
    import yaml

    from replicheck.controller.config import config_from_mapping
    from replicheck.controller.wiring import load_settings

    docs = [d for d in yaml.safe_load_all((DEPLOY / "controller.yaml").read_text()) if d]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    path = tmp_path / "config.toml"
    path.write_text(cm["data"]["config.toml"])
    settings = load_settings(path)
    assert settings.backend == "kubernetes" and settings.controller.apply is False
    assert config_from_mapping(settings.kubernetes, KubernetesConfig).remediation == "hyperpod-replace"
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"


def test_new_backends_never_import_torch(server: FakeApiServer) -> None:
    """Importing both backends and the Kubernetes simulation, and using the kubernetes backend, in a fresh interpreter leaves torch unimported."""
    import subprocess

    code = (
        "import sys\n"
        "from replicheck.controller.backends.kubernetes import KubernetesBackend, KubernetesConfig\n"
        "import replicheck.controller.backends.hyperpod, replicheck.simulation.kubernetes_demo\n"
        f"KubernetesBackend(KubernetesConfig(host={server.url!r})).list_nodes()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr


@pytest.mark.timeout(180)
def test_selftest_job_runs_the_real_selftest_command(server: FakeApiServer) -> None:
    """The fake Job runs the Job's own container command (the real ``replicheck selftest``, on CPU); the backend reads its output."""
    import subprocess

    def run_container(job: dict[str, Any]) -> tuple[bool, str]:
        (container,) = job["spec"]["template"]["spec"]["containers"]
        argv = [sys.executable, "-m", "replicheck", *container["command"][1:]]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=150)
        return done.returncode == 0, done.stdout + done.stderr

    server.job_polls_until_done = 0
    server.job_runner = run_container
    b = backend(
        server,
        triage_command=("replicheck", "selftest", "--json", "--device", "cpu", "--steps", "1"),
        triage_gpu_resource="",
    )
    with pytest.raises(NotYet):
        b.selftest("n2", "i:selftest:n2")
    result = b.selftest("n2", "i:selftest:n2")
    assert result["passed"] is True and len(str(result["fingerprint"])) >= 8
    (post, _) = [r for r in server.requests if r.method == "POST"]
    assert "resources" not in post.body["spec"]["template"]["spec"]["containers"][0]
