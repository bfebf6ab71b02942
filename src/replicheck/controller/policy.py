"""Pure policy checks the executor applies before a destructive call."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def cordon_refusal(node: str, schedulable_by_partition: Mapping[str, Sequence[str]]) -> str | None:
    """Why cordoning ``node`` is refused, or None when allowed.

    ``schedulable_by_partition`` maps each partition that contains ``node`` to the nodes of that
    partition that are schedulable right now. Cordoning the last one would leave the job's
    partition unable to run anything (including its own restart), so it is refused.
    """
    for partition, nodes in sorted(schedulable_by_partition.items()):
        others = [n for n in nodes if n != node]
        if node in nodes and not others:
            return f"last schedulable node of partition {partition}"
    return None


def retry_delay(attempt: int, base_s: float, max_s: float) -> float:
    """Exponential backoff: base, 2*base, 4*base, ... capped at ``max_s`` (attempt counts from 1)."""
    return float(min(max_s, base_s * (2 ** max(0, attempt - 1))))
