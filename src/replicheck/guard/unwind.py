"""Ending a synchronising backward that raised on this rank without leaving the others in DDP's
all-reduce.

An error raised inside autograd (a user's tensor hook) stops this rank's backward before every
gradient bucket is ready, so its reducer never launches the remaining all-reduces, while the
other ranks launch theirs and wait. DDP's reducer launches buckets strictly in index order, so
the launched ones are a prefix; this rank then takes part in the rest with zero buckets through
the same communication hook, as DDP's own ``join`` does for a rank that ran out of data.
"""

# No `from __future__ import annotations`: DDP inspects the comm hook's annotations at runtime.
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch._C._distributed_c10d import GradBucket
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger(__name__)

CommHook = Callable[[Any, GradBucket], "torch.futures.Future[torch.Tensor]"]


class BucketCount:
    """Counts the buckets DDP hands the communication hook in one synchronising backward."""

    def __init__(self) -> None:
        self.launched = 0

    def wrap(self, hook: CommHook) -> CommHook:
        """``hook``, counting its calls (registered in its place)."""

        def counted(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
            self.launched += 1
            return hook(state, bucket)

        return counted


def finish_reductions(ddp: DistributedDataParallel, launched: int) -> None:
    """Run the communication hook on zeros for every bucket after the first ``launched`` and wait.

    The gradients are discarded anyway: the step fails on every rank at its next collective.
    """
    try:
        buckets = ddp.reducer._get_zeros_like_grad_buckets()
        works = [ddp.reducer._run_comm_hook(b) for b in buckets[launched:]]
        for w in works:
            w.wait()
    except Exception:  # noqa: BLE001 - the original error is what this rank reports
        log.exception("could not complete the gradient all-reduces after a failed backward")
