"""The verification ring, votes and pair attribution (pure functions)."""

from __future__ import annotations

import pytest

from replicheck.guard.attribution.ring import Ring
from replicheck.guard.attribution.verdict import (
    Finding,
    arbitrate,
    attribute_pairs,
    primary,
    vote,
)

pytestmark = pytest.mark.timeout(30)


def test_ring_visits_nodes_round_robin() -> None:
    """With 2 nodes x 2 ranks the ring alternates nodes and forms one cycle, not mutual pairs."""
    ring = Ring.build(["a", "a", "b", "b"])
    assert ring.order == (0, 2, 1, 3)
    for src, ver in ring.pairs():
        assert ring.nodes[src] != ring.nodes[ver]
    assert {ring.verifier_of(r) for r in range(4)} == {0, 1, 2, 3}
    assert ring.verifier_of(0) == 2 and ring.verifier_of(2) == 1  # not 0<->2 mutual


def test_ring_with_uneven_nodes_is_a_single_cycle() -> None:
    """Uneven node sizes still give one cycle over every rank."""
    ring = Ring.build(["a", "a", "a", "b"])
    seen, r = [], 0
    for _ in range(4):
        seen.append(r)
        r = ring.verifier_of(r)
    assert sorted(seen) == [0, 1, 2, 3] and r == 0


def test_arbiter_prefers_a_third_node() -> None:
    """The arbiter of a disputed pair sits on a node that hosts neither party when possible."""
    ring = Ring.build(["a", "b", "c", "a", "b", "c"])
    arb = ring.arbiter_for(0, 1)
    assert arb is not None and ring.nodes[arb] == "c"
    assert Ring.build(["a", "b"]).arbiter_for(0, 1) is None


def test_vote_names_minority_and_refuses_ties() -> None:
    """A strict majority names the dissenters; a 1-1 split names nobody."""
    assert vote([5, 5, 7]).dissenters == (2,)
    assert vote([5, 5, 5]).agree
    tie = vote([5, 7])
    assert not tie.agree and tie.dissenters == () and tie.candidates == (0, 1)


def test_two_failing_pairs_name_the_shared_rank() -> None:
    """A rank in two failing pairs (once source, once verifier) is the suspect."""
    a = attribute_pairs([(0, 1), (1, 2)])
    assert a.suspects == (1,) and a.unexplained == ()


def test_two_rank_ring_cannot_attribute() -> None:
    """In a ring of two, both ranks share both failing pairs: nobody is named."""
    a = attribute_pairs([(0, 1), (1, 0)])
    assert a.suspects == () and len(a.unexplained) == 2


def test_lone_pair_needs_arbitration() -> None:
    """A lone failing pair is left for an arbiter; its verdict names the odd one out."""
    assert attribute_pairs([(2, 0)]).unexplained == ((2, 0),)
    assert arbitrate(False, True, source=2, verifier=0) == 2
    assert arbitrate(True, False, source=2, verifier=0) == 0
    assert arbitrate(False, False, source=2, verifier=0) is None


def test_primary_prefers_direct_evidence() -> None:
    """When several checks fail, the per-step gradient check is reported before the replay."""
    f = primary([Finding(check="replay", suspects=(1,)), Finding(check="gradients", suspects=(1,))])
    assert f.check == "gradients"
