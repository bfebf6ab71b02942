"""DDP's communication hook: the guard's view of each rank's gradient, and how a synchronising
backward that raised on this rank ends without leaving the others in DDP's all-reduce.

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
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket  # torch's stubs do not re-export it from torch.distributed
from torch.nn.parallel import DistributedDataParallel

from replicheck import fingerprint as fp
from replicheck.guard.checks.health import GradStats, sq_norm

log = logging.getLogger(__name__)

CommHook = Callable[[Any, GradBucket], "torch.futures.Future[torch.Tensor]"]


class GradHealth(GradStats):
    """Collects, for one step, the local gradient norm and the digest of the reduced gradient.

    Everything stays on the gradients' device and nothing here waits for it: the results are
    0-dim device tensors that ride in the step's row (one host transfer per step, after the
    all-gather), so the comm hook never stalls the overlap of backward and all-reduce.

    As a DDP communication hook it sees every bucket before the all-reduce (so a non-finite or
    huge local gradient is attributed to the rank that produced it) and after it (so every
    rank's reduced gradient can be compared bit for bit). It reduces the way DDP does without a
    hook: multiply by the reciprocal of the world size, then all-reduce a sum.
    """

    def __init__(self, group: dist.ProcessGroup | None, digest_reduced: bool) -> None:
        self.group = group
        super().__init__(digest_reduced)

    # -- DDP communication hook -------------------------------------------------------------
    def comm_hook(self, state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        # Squared norm: one streaming read; NaN and Inf propagate into it.
        self._local_sq.append(sq_norm(buf))
        # A multiply by the reciprocal, as DDP's reducer divides without a hook: the same bits
        # as the plain DDP loop at any world size (a division rounds differently at 3 ranks).
        buf.mul_(1.0 / dist.get_world_size(self.group))
        work = dist.all_reduce(buf, group=self.group, async_op=True)
        fut: torch.futures.Future[list[torch.Tensor]] = work.get_future()
        index = bucket.index()

        def after(f: "torch.futures.Future[list[torch.Tensor]]") -> torch.Tensor:
            out = f.value()[0]
            self._run_hooks(index, out)
            if self.digest_reduced:
                self._reduced[index] = fp.row_digest(out)
            return out

        return fut.then(after)


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
