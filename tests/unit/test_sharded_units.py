"""Pieces of the sharded (FSDP2/HSDP) guard that need no process group."""

from __future__ import annotations

import pytest
import torch

from replicheck.guard.checks.replicas import group_finding
from replicheck.guard.parallel.fsdp import ShardLayout
from replicheck.guard.step.replay import Fingerprinter


def test_hsdp_layout_groups_the_ranks_holding_one_shard() -> None:
    """A 2×2 mesh [[0, 1], [2, 3]] compares rank 0 with 2 and rank 1 with 3; plain FSDP2
    (one replica group) has nothing to compare."""
    hsdp = ShardLayout(replicas=2, shards=2, same_shard=((0, 2), (1, 3)))
    assert hsdp.groups_of(4) == [[0, 2], [1, 3]]
    fsdp = ShardLayout(replicas=1, shards=3, same_shard=((0,), (1,), (2,)))
    assert fsdp.groups_of(3) == []


def test_group_vote_names_the_dissenter_by_global_rank_with_a_majority() -> None:
    """Three replica groups: rank 4 differs from ranks 0 and 2 holding the same shard and is
    named; the other shard's group agrees and adds nothing."""
    values = [7, 5, 7, 5, 8, 5]
    f = group_finding("weights", values, [[0, 2, 4], [1, 3, 5]])
    assert f is not None and f.suspects == (4,) and f.classification == "transient"
    assert f.evidence["groups"][0]["ranks"] == [0, 2, 4]


def test_group_vote_without_a_majority_is_ambiguous_between_the_replicas() -> None:
    """Two replica groups that disagree on shard 1 leave ranks 1 and 3 as candidates."""
    f = group_finding("optimizer_state", [1, 2, 1, 3], [[0, 2], [1, 3]])
    assert f is not None and f.suspects == () and f.candidates == (1, 3)


def test_groups_that_agree_give_no_finding() -> None:
    """Different shards differ from each other; only replicas of the same shard are compared."""
    assert group_finding("reduced_gradients", [1, 2, 1, 2], [[0, 2], [1, 3]]) is None


@pytest.mark.parametrize("mode", ["exact", "tolerant"])
def test_fingerprint_parts_join_to_the_fingerprint_of_the_list(mode: str) -> None:
    """Fingerprinting gradients one at a time as a sharded backward produces them gives the
    same fingerprint as fingerprinting the whole list at once."""
    fpr = Fingerprinter(mode, sketch_k=4, sketch_block=64)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(300, generator=g), torch.randn(7, 5, generator=g), torch.zeros(64)]
    part = fpr.part(seed=11)
    joined = fpr.join([part(t, i) for i, t in enumerate(grads)])
    assert torch.equal(joined, fpr(grads, 11))


def test_shard_digest_leaves_out_what_replicas_hold_differently_as_ddp_does() -> None:
    """The sharded weights digest covers the same tensors as DDP's replicated digest: running
    BatchNorm statistics (each replica group updates its own) and per-rank buffers do not change
    it, a parameter does."""
    from replicheck import fingerprint as fp
    from replicheck.guard.shards import weights_digest

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model.register_buffer("seen", torch.zeros(1))
    before = int(weights_digest(model, ["seen"]))
    assert before == int(fp.model_digest_tensor(model, "replicated", per_rank=["seen"]))
    model(torch.randn(5, 3))  # updates the running statistics
    model.seen += 1
    assert int(weights_digest(model, ["seen"])) == before
    with torch.no_grad():
        model[0].weight[0, 0] += 1.0
    assert int(weights_digest(model, ["seen"])) != before
