"""The ``hyperpod`` backend on a real boto3 ``sagemaker`` client with botocore's Stubber.

No AWS account is reachable from here; the Stubber answers instead, while botocore's own
service model still validates every request's parameters (types, required members, list
lengths) and every stubbed response's shape. A call the test did not queue fails the test,
which is how "no second replacement call" is proven.
"""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import ANY, Stubber
from ctlkit import Clock, make_incident

from replicheck.controller import Controller, ControllerConfig, State
from replicheck.controller.backends.hyperpod import BATCH_LIMIT, HyperPodBackend, HyperPodConfig
from replicheck.controller.errors import ConfigError, NotYet, PermanentBackendError, TransientBackendError

pytestmark = pytest.mark.timeout(60)

CLUSTER = "ml-cluster"
OLD, NEW, OTHER = "i-0123456789abcdef0", "i-0fedcba9876543210", "i-0aaaaaaaaaaaaaaaa"
T0 = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)


def summary(
    iid: str,
    ip: str,
    status: str = "Running",
    group: str = "workers",
    launched: dt.datetime = T0 - dt.timedelta(days=1),
) -> dict[str, Any]:
    return {
        "InstanceGroupName": group,
        "InstanceId": iid,
        "InstanceType": "ml.p5.48xlarge",
        "LaunchTime": launched,
        "InstanceStatus": {"Status": status},
        "PrivateDnsHostname": f"ip-{ip.replace('.', '-')}.ec2.internal",
    }


def cluster_page(*nodes: dict[str, Any], token: str | None = None) -> dict[str, Any]:
    page: dict[str, Any] = {"ClusterNodeSummaries": list(nodes)}
    if token:
        page["NextToken"] = token
    return page


@pytest.fixture
def sm() -> Iterator[tuple[Any, Stubber]]:
    client = boto3.client(
        "sagemaker", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )
    with Stubber(client) as stub:
        yield client, stub
        stub.assert_no_pending_responses()


class _Allocated(HyperPodBackend):
    """HyperPod without an orchestrator cannot verify a job (allocation() is None: tested in
    test_job_authority.py); these tests are about replacing, so job1 runs on every node."""

    def allocation(self, job_id: str) -> frozenset[str] | None:
        return frozenset({"ip-10-0-0-1", "ip-10-0-0-2", "ip-10-0-0-3", "n1", "n2", "n3"})


def hp(client: Any, clock: Clock | None = None, **config: Any) -> HyperPodBackend:
    return _Allocated(HyperPodConfig(cluster_name=CLUSTER, **config), client=client, clock=clock)


def expect_list(stub: Stubber, *nodes: dict[str, Any], **params: Any) -> None:
    stub.add_response("list_cluster_nodes", cluster_page(*nodes), {"ClusterName": CLUSTER, **params})


def two_pages(stub: Stubber, status: str = "Running") -> None:
    stub.add_response(
        "list_cluster_nodes", cluster_page(summary(OTHER, "10.0.0.1"), token="t1"), {"ClusterName": CLUSTER}
    )
    stub.add_response(
        "list_cluster_nodes",
        cluster_page(summary(OLD, "10.0.0.2", status)),
        {"ClusterName": CLUSTER, "NextToken": "t1"},
    )


# --- mapping ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ip-10-0-0-2", "ip-10-0-0-2.ec2.internal", OLD, f"hyperpod-{OLD}"])
def test_node_name_maps_to_instance_across_pages(sm: tuple[Any, Stubber], name: str) -> None:
    """Host name, private DNS name, instance id and EKS node name all map to the instance found on page 2."""
    client, stub = sm
    two_pages(stub)
    assert hp(client).instance(name)["InstanceId"] == OLD


def test_unknown_node_is_permanent(sm: tuple[Any, Stubber]) -> None:
    """A name no instance has is a permanent error, and nothing is replaced."""
    client, stub = sm
    two_pages(stub)
    with pytest.raises(PermanentBackendError, match="no instance"):
        hp(client).schedulable_by_partition("ip-10-9-9-9")


# --- replacement ------------------------------------------------------------------------------


def test_replace_calls_batch_replace_with_the_instance_id(sm: tuple[Any, Stubber]) -> None:
    """replace maps the node, sees it Running, and calls BatchReplaceClusterNodes with exactly its id."""
    client, stub = sm
    two_pages(stub)
    stub.add_response(
        "batch_replace_cluster_nodes", {"Successful": [OLD]}, {"ClusterName": CLUSTER, "NodeIds": [OLD]}
    )
    assert hp(client).replace("ip-10-0-0-2", "inc:replace:ip-10-0-0-2")["instance_id"] == OLD


def test_reboot_action_calls_batch_reboot(sm: tuple[Any, Stubber]) -> None:
    """action=reboot uses BatchRebootClusterNodes instead."""
    client, stub = sm
    two_pages(stub)
    stub.add_response(
        "batch_reboot_cluster_nodes", {"Successful": [OLD]}, {"ClusterName": CLUSTER, "NodeIds": [OLD]}
    )
    assert "reboot of" in hp(client, action="reboot").replace("ip-10-0-0-2", "k")["detail"]


@pytest.mark.parametrize("status", ["ShuttingDown", "Pending", "SystemUpdating"])
def test_restart_after_request_makes_no_second_call(sm: tuple[Any, Stubber], status: str) -> None:
    """A fresh backend (restarted controller) that finds the instance busy sends no second replace request."""
    client, stub = sm
    two_pages(stub, status)
    assert "already under way" in hp(client).replace("ip-10-0-0-2", "k")["detail"]


def test_in_use_answer_counts_as_already_requested(sm: tuple[Any, Stubber]) -> None:
    """When the status still lags (Running) and the API answers InstanceIdInUse, the replacement is under way: success."""
    client, stub = sm
    two_pages(stub)
    stub.add_response(
        "batch_replace_cluster_nodes",
        {"Failed": [{"NodeId": OLD, "ErrorCode": "InstanceIdInUse", "Message": "replacement in progress"}]},
        {"ClusterName": CLUSTER, "NodeIds": [OLD]},
    )
    assert "already under way" in hp(client).replace("ip-10-0-0-2", "k")["detail"]


@pytest.mark.parametrize(
    "code,error",
    [
        ("InstanceIdNotFound", PermanentBackendError),
        ("InvalidInstanceStatus", TransientBackendError),
        ("InternalServerError", TransientBackendError),
    ],
)
def test_failed_entries_become_permanent_or_temporary(
    sm: tuple[Any, Stubber], code: str, error: type
) -> None:
    """A per-node Failed entry becomes a permanent or temporary error by its code."""
    client, stub = sm
    two_pages(stub)
    stub.add_response(
        "batch_replace_cluster_nodes",
        {"Failed": [{"NodeId": OLD, "ErrorCode": code, "Message": "m"}]},
        {"ClusterName": CLUSTER, "NodeIds": [OLD]},
    )
    with pytest.raises(error, match=code) as info:
        hp(client).replace("ip-10-0-0-2", "k")
    assert error is TransientBackendError or not isinstance(info.value, TransientBackendError)


def test_batches_hold_at_most_25_ids_and_report_partial_failures(sm: tuple[Any, Stubber]) -> None:
    """27 ids go out as 25 + 2; only the Failed entries come back, keyed by id."""
    client, stub = sm
    ids = [f"i-{n:017x}" for n in range(27)]
    stub.add_response(
        "batch_replace_cluster_nodes",
        {
            "Successful": ids[1:25],
            "Failed": [{"NodeId": ids[0], "ErrorCode": "InstanceIdNotFound", "Message": "gone"}],
        },
        {"ClusterName": CLUSTER, "NodeIds": ids[:BATCH_LIMIT]},
    )
    stub.add_response(
        "batch_replace_cluster_nodes", {"Successful": ids[25:]}, {"ClusterName": CLUSTER, "NodeIds": ids[25:]}
    )
    assert hp(client).request(ids) == {ids[0]: ("InstanceIdNotFound", "gone")}


@pytest.mark.parametrize(
    "code,status,error",
    [
        ("ThrottlingException", 400, TransientBackendError),
        ("ServiceUnavailable", 503, TransientBackendError),
        ("AccessDeniedException", 400, PermanentBackendError),
        ("ResourceNotFound", 400, PermanentBackendError),
    ],
)
def test_api_errors_map_to_permanent_or_temporary(
    sm: tuple[Any, Stubber], code: str, status: int, error: type
) -> None:
    """Throttling and 5xx are temporary; access denied and an unknown cluster are permanent."""
    client, stub = sm
    stub.add_client_error(
        "list_cluster_nodes",
        service_error_code=code,
        http_status_code=status,
        expected_params={"ClusterName": CLUSTER},
    )
    with pytest.raises(error, match=code) as info:
        hp(client).replace("ip-10-0-0-2", "k")
    assert error is TransientBackendError or not isinstance(info.value, TransientBackendError)


# --- waiting for the node -----------------------------------------------------------------------


def describe(stub: Stubber, status: str) -> None:
    stub.add_response(
        "describe_cluster_node",
        {
            "NodeDetails": {
                "InstanceId": OLD,
                "InstanceGroupName": "workers",
                "InstanceStatus": {"Status": status},
            }
        },
        {"ClusterName": CLUSTER, "NodeId": OLD},
    )


def test_replacement_is_awaited_until_a_new_instance_runs(sm: tuple[Any, Stubber]) -> None:
    """The old instance shutting down is NotYet; once gone, a new Running instance of its group is the replacement."""
    client, stub = sm
    clock = Clock()
    b = hp(client, clock)
    two_pages(stub)
    stub.add_response(
        "batch_replace_cluster_nodes", {"Successful": [OLD]}, {"ClusterName": CLUSTER, "NodeIds": [OLD]}
    )
    b.replace("ip-10-0-0-2", "k:replace")
    describe(stub, "ShuttingDown")
    with pytest.raises(NotYet, match="ShuttingDown"):
        b.await_return("ip-10-0-0-2", "k:await_return")
    clock.advance(300)

    def old_gone_new_is(state: str) -> None:
        """The old instance is gone; the group's new one (launched after the request) is in ``state``."""
        stub.add_client_error(
            "describe_cluster_node",
            service_error_code="ResourceNotFound",
            http_status_code=400,
            expected_params={"ClusterName": CLUSTER, "NodeId": OLD},
        )
        expect_list(
            stub,
            summary(NEW, "10.0.0.7", state, launched=T0 + dt.timedelta(seconds=60)),
            InstanceGroupNameContains="workers",
            CreationTimeAfter=ANY,
        )

    old_gone_new_is("Pending")
    with pytest.raises(NotYet, match="not Running yet"):
        b.await_return("ip-10-0-0-2", "k:await_return")
    old_gone_new_is("Running")
    result = b.await_return("ip-10-0-0-2", "k:await_return")
    assert result == {
        "back": False,
        "replacement": "ip-10-0-0-7",
        "instance_id": NEW,
        "detail": f"ip-10-0-0-2 ({OLD}) replaced by ip-10-0-0-7 ({NEW})",
    }


def test_reboot_is_back_only_after_the_status_moved(sm: tuple[Any, Stubber]) -> None:
    """After a reboot request a still-Running status is NotYet; after Pending, Running again is back."""
    client, stub = sm
    b = hp(client, Clock(), action="reboot")
    two_pages(stub)
    stub.add_response(
        "batch_reboot_cluster_nodes", {"Successful": [OLD]}, {"ClusterName": CLUSTER, "NodeIds": [OLD]}
    )
    b.replace("ip-10-0-0-2", "k")
    for status in ("Running", "Pending"):
        describe(stub, status)
        with pytest.raises(NotYet):
            b.await_return("ip-10-0-0-2", "k")
    describe(stub, "Running")
    assert b.await_return("ip-10-0-0-2", "k")["back"] is True


def test_failed_instance_is_not_back(sm: tuple[Any, Stubber]) -> None:
    """An instance in Failure after the request is reported not back (the resume excludes it)."""
    client, stub = sm
    b = hp(client, Clock())
    two_pages(stub)
    stub.add_response(
        "batch_replace_cluster_nodes", {"Successful": [OLD]}, {"ClusterName": CLUSTER, "NodeIds": [OLD]}
    )
    b.replace("ip-10-0-0-2", "k")
    describe(stub, "Failure")
    assert b.await_return("ip-10-0-0-2", "k")["back"] is False


# --- with the controller ----------------------------------------------------------------------


class Killed(BaseException):
    """Stands for the controller process dying right after a backend call returned."""


class DiesAfterReplace:
    def __init__(self, inner: HyperPodBackend) -> None:
        self.inner, self.name = inner, inner.name

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.inner, name)
        if name != "replace":
            return fn

        def call(*args: Any) -> Any:
            fn(*args)
            raise Killed()

        return call


def test_controller_killed_between_request_and_record_replaces_once(
    sm: tuple[Any, Stubber], tmp_path: Path
) -> None:
    """Killed after BatchReplaceClusterNodes returned, a restarted controller finds ShuttingDown and sends no second request."""
    client, stub = sm
    clock = Clock()
    db, config = tmp_path / "c.db", ControllerConfig(apply=True, checkpoint_roots=("/ck",), auto_approve=True)
    inc = make_incident(nodes=("ip-10-0-0-2",))
    # First run: last-node check (lookup + listing), cordon (lookup only: no orchestrator), replace (lookup).
    for _ in range(4):
        two_pages(stub)
    stub.add_response(
        "batch_replace_cluster_nodes", {"Successful": [OLD]}, {"ClusterName": CLUSTER, "NodeIds": [OLD]}
    )
    ctl = Controller(db, backend=DiesAfterReplace(hp(client, clock)), config=config, clock=clock)
    ctl.ingest(inc, vouched_by="job token job1 (jobs=job1)")
    with pytest.raises(Killed):
        ctl.reconcile()
    ctl.close()
    stub.assert_no_pending_responses()
    # Restarted: the in-flight replace is repeated, observes ShuttingDown and calls nothing;
    # await_return then polls the instance it saw.
    two_pages(stub, "ShuttingDown")
    describe(stub, "ShuttingDown")
    ctl = Controller(db, backend=hp(client, clock), config=config, clock=clock)
    ctl.reconcile()
    assert ctl.store.get_record(inc.id).state is State.REPLACING
    (replace,) = [a for a in ctl.store.actions(inc.id) if a.kind.value == "replace"]
    assert replace.status == "done" and "already under way" in str(replace.result)
    ctl.close()


def test_throttled_replace_is_retried_by_the_controller(sm: tuple[Any, Stubber], tmp_path: Path) -> None:
    """A throttled BatchReplaceClusterNodes is a temporary error: the controller retries it later and it succeeds once."""
    client, stub = sm
    clock = Clock()
    config = ControllerConfig(apply=True, checkpoint_roots=("/ck",), auto_approve=True, retry_base_delay_s=1)
    inc = make_incident(nodes=("ip-10-0-0-2",))
    for _ in range(4):
        two_pages(stub)
    stub.add_client_error(
        "batch_replace_cluster_nodes",
        service_error_code="ThrottlingException",
        http_status_code=400,
        expected_params={"ClusterName": CLUSTER, "NodeIds": [OLD]},
    )
    ctl = Controller(tmp_path / "c.db", backend=hp(client, clock), config=config, clock=clock)
    ctl.ingest(inc, vouched_by="job token job1 (jobs=job1)")
    ctl.reconcile()
    (replace,) = [a for a in ctl.store.actions(inc.id) if a.kind.value == "replace"]
    assert replace.status == "pending" and "ThrottlingException" in str(replace.last_error)
    stub.assert_no_pending_responses()
    two_pages(stub)
    stub.add_response(
        "batch_replace_cluster_nodes", {"Successful": [OLD]}, {"ClusterName": CLUSTER, "NodeIds": [OLD]}
    )
    describe(stub, "ShuttingDown")
    clock.advance(5)
    ctl.reconcile()
    actions = {a.kind.value: a for a in ctl.store.actions(inc.id)}
    assert actions["replace"].status == "done" and actions["await_return"].status == "pending"
    ctl.close()


# --- configuration ----------------------------------------------------------------------------


def test_config_needs_a_cluster_and_valid_choices() -> None:
    """A missing cluster name, an unknown action or orchestrator are ConfigErrors."""
    with pytest.raises(ConfigError, match="cluster_name"):
        HyperPodBackend(HyperPodConfig(), client=object())
    with pytest.raises(ConfigError, match="action"):
        HyperPodConfig(cluster_name=CLUSTER, action="reimage")
    with pytest.raises(ConfigError, match="orchestrator"):
        HyperPodConfig(cluster_name=CLUSTER, orchestrator="pbs")


def test_wiring_builds_hyperpod_over_kubernetes(tmp_path: Path) -> None:
    """[hyperpod] orchestrator = "kubernetes" builds a HyperPod backend whose cordon goes to Kubernetes."""
    from replicheck.controller.backends.kubernetes import KubernetesBackend
    from replicheck.controller.wiring import load_settings, make_backend

    path = tmp_path / "c.toml"
    path.write_text(
        '[controller]\nbackend = "hyperpod"\n[hyperpod]\ncluster_name = "ml"\nregion = "us-east-1"\n'
        'orchestrator = "kubernetes"\n[kubernetes]\nhost = "http://127.0.0.1:9"\n'
    )
    made = make_backend(load_settings(path), tmp_path / "c.db")
    assert isinstance(made, HyperPodBackend) and isinstance(made._orchestrator, KubernetesBackend)


def test_missing_boto3_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without boto3 the error says which extra to install."""
    monkeypatch.setitem(sys.modules, "boto3", None)
    with pytest.raises(ImportError, match=r"replicheck\[hyperpod\]"):
        HyperPodBackend(HyperPodConfig(cluster_name=CLUSTER))


def test_restart_after_instance_is_gone_sends_nothing(sm: tuple[Any, Stubber]) -> None:
    """A restarted controller whose replaced instance is already terminated sends no request and reports it not back."""
    client, stub = sm
    expect_list(stub, summary(OTHER, "10.0.0.1"))
    assert "no such instance any more" in hp(client).replace("ip-10-0-0-2", "k:replace")["detail"]
    expect_list(stub, summary(OTHER, "10.0.0.1"))
    result = hp(client).await_return("ip-10-0-0-2", "k:await_return")
    assert result["back"] is False and result["replacement"] is None


def test_replacement_not_back_by_the_deadline_is_excluded(sm: tuple[Any, Stubber], tmp_path: Path) -> None:
    """DescribeClusterNode polled through the controller: past return_timeout_s the node counts as not back and the job resumes."""
    client, stub = sm
    clock = Clock()
    config = ControllerConfig(
        apply=True, checkpoint_roots=("/ck",), auto_approve=True, return_poll_s=5, return_timeout_s=30
    )
    inc = make_incident(nodes=("ip-10-0-0-2",))
    for _ in range(4):
        two_pages(stub)
    stub.add_response(
        "batch_replace_cluster_nodes", {"Successful": [OLD]}, {"ClusterName": CLUSTER, "NodeIds": [OLD]}
    )
    describe(stub, "ShuttingDown")
    ctl = Controller(tmp_path / "c.db", backend=hp(client, clock), config=config, clock=clock)
    ctl.ingest(inc, vouched_by="job token job1 (jobs=job1)")
    ctl.reconcile()
    assert ctl.store.get_record(inc.id).state is State.REPLACING
    stub.assert_no_pending_responses()
    clock.advance(31)
    describe(stub, "ShuttingDown")
    assert [t.to_state for t in ctl.reconcile()] == [State.REPLACED, State.RESUMED]
    assert ctl.store.get_record(inc.id).returned == (("ip-10-0-0-2", False, None),)
    ctl.close()


def test_last_node_rule_without_orchestrator_uses_instance_groups(sm: tuple[Any, Stubber]) -> None:
    """With no orchestrator the Running instances of the node's group are its schedulable nodes, under the caller's name."""
    client, stub = sm
    two_pages(stub)
    two_pages(stub)
    assert hp(client).schedulable_by_partition(OLD) == {"workers": ["ip-10-0-0-1", OLD]}


def test_dry_run_calls_nothing(sm: tuple[Any, Stubber], tmp_path: Path) -> None:
    """With the default dry-run the controller makes no HyperPod call at all (any call would fail the Stubber)."""
    client, stub = sm
    ctl = Controller(
        tmp_path / "c.db",
        backend=hp(client, Clock()),
        config=ControllerConfig(auto_approve=True),
        clock=Clock(),
    )
    inc = make_incident(nodes=("ip-10-0-0-2",))
    ctl.ingest(inc, vouched_by="job token job1 (jobs=job1)")
    ctl.reconcile()
    # The read-only allocation check runs in dry-run too (answered by _Allocated, not HyperPod).
    by_kind = {a.kind.value: a for a in ctl.store.actions(inc.id)}
    assert sorted(by_kind) == ["cordon", "verify"] and by_kind["verify"].status == "done"
    cordon = by_kind["cordon"]
    assert cordon.status == "pending" and "dry-run" in str(cordon.last_error)
    assert ctl.store.get_record(inc.id).state is State.DETECTED
    ctl.close()
