"""The comm hook of :class:`~replicheck.guard.parallel.torchft.TorchftReplicas`: the guard's view of
each bucket of this rank's gradient, its average inside the replica group, then torchft's average
over the quorum."""

# No `from __future__ import annotations`: DDP inspects the comm hook's annotations at runtime.
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket  # torch's stubs do not re-export it from torch.distributed

from replicheck import fingerprint as fp
from replicheck.guard.checks.health import GradStats, sq_norm
from replicheck.guard.errors import GuardConfigError


class TorchftGradHealth(GradStats):
    """The guard's view of each bucket of this rank's gradient (local squared norm), then its
    average inside the replica group (``group``, several ranks), then the average over the quorum
    through ``Manager.allreduce`` (what torchft's own DDP hook does), then the reduced bucket's
    digest and the reduced-gradient hooks. The mean of means is the mean over every rank: the
    groups in a quorum have the same size."""

    def __init__(self, manager: Any, group: Any, digest_reduced: bool) -> None:
        self.manager = manager
        self.group = group
        super().__init__(digest_reduced)

    def comm_hook(self, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        self._local_sq.append(sq_norm(buf))
        index = bucket.index()
        if self.group is not None:
            # Waited for here: torchft's all-reduce must see the group's sum, and the wait is
            # over the group's ranks only (cost flat in the number of groups).
            buf.div_(dist.get_world_size(self.group))
            dist.all_reduce(buf, group=self.group)
        work = self.manager.allreduce(buf)
        work.wait()
        # torchft's DDP hook hands DDP the future under its managed wrapper (the wrapper's own
        # value() is not implemented); the division by the participants is chained on it.
        fut: torch.futures.Future[torch.Tensor] = work.get_future()._fut

        def after(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            out = f.value()
            self._run_hooks(index, out)
            if self.digest_reduced:
                self._reduced[index] = fp.row_digest(out)
            return out

        return fut.then(after)


def comm_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's comm hook; ``state`` is the parallelism, whose newest guard's view takes the bucket."""
    health = state.health
    if health is None:
        raise GuardConfigError("internal: a synchronising backward before the guard was installed")
    out: torch.futures.Future[torch.Tensor] = health.comm_hook(bucket)
    return out
