"""One object per kind of parallel job behind one seam (:mod:`replicheck.guard.parallel.base`).

Importing this package registers the built-in kinds, most specific first: a ``fully_shard``
model (FSDP2, HSDP), a ``DistributedDataParallel`` model, then a bare module in a one-process job.
"""

from replicheck.guard.parallel.base import Parallelism, Replays, detect, register
from replicheck.guard.parallel.ddp import DataParallel
from replicheck.guard.parallel.fsdp import Sharded
from replicheck.guard.parallel.single import SingleProcess

register(Sharded.claim)
register(DataParallel.claim)
register(SingleProcess.claim)

__all__ = ["DataParallel", "Parallelism", "Replays", "SingleProcess", "Sharded", "detect", "register"]
