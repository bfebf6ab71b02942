"""Who verifies whom: a ring that visits the nodes round-robin, and arbiters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Ring:
    """The verification ring of a job: ``verifier_of[r]`` replays rank ``r``'s probe."""

    order: tuple[int, ...]
    """Ranks in ring order: n0's first rank, n1's first rank, ..., n0's second rank, ..."""
    nodes: tuple[str, ...]
    """Node name of every rank, indexed by rank."""

    @classmethod
    def build(cls, nodes: Sequence[str]) -> Ring:
        """Ring over ranks whose node names are ``nodes[rank]``.

        Pairing "same local index on the next node" makes mutual pairs (0↔2, 1↔3 with 2×2),
        where a faulty rank and its partner fail symmetrically. Visiting nodes round-robin
        makes one cycle in which consecutive ranks sit on different nodes whenever there are
        two or more, so a persistent fault fails two pairs that share only the faulty rank.
        """
        by_node: dict[str, list[int]] = {}
        for rank, node in enumerate(nodes):
            by_node.setdefault(node, []).append(rank)
        columns = list(by_node.values())
        order: list[int] = []
        depth = max((len(c) for c in columns), default=0)
        for i in range(depth):
            order.extend(c[i] for c in columns if i < len(c))
        return cls(order=tuple(order), nodes=tuple(nodes))

    @property
    def world_size(self) -> int:
        return len(self.order)

    def verifier_of(self, rank: int) -> int:
        i = self.order.index(rank)
        return self.order[(i + 1) % len(self.order)]

    def source_of(self, rank: int) -> int:
        i = self.order.index(rank)
        return self.order[(i - 1) % len(self.order)]

    def pairs(self) -> list[tuple[int, int]]:
        """Every ``(source, verifier)`` pair, in ring order."""
        return [(r, self.verifier_of(r)) for r in self.order]

    def arbiter_for(self, source: int, verifier: int, busy: Sequence[int] = ()) -> int | None:
        """A third rank to replay a disputed probe, preferring a node that hosts neither party.

        Ranks in ``busy`` are avoided when another choice exists. ``None`` when the job has no
        third rank.
        """
        others = [r for r in self.order if r not in (source, verifier)]
        if not others:
            return None
        start = self.order.index(verifier)
        others.sort(key=lambda r: (self.order.index(r) - start) % len(self.order))
        far = {self.nodes[source], self.nodes[verifier]}

        def rank_key(r: int) -> tuple[int, int]:
            return (self.nodes[r] in far, r in busy)

        return min(others, key=lambda r: rank_key(r))
