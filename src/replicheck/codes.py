"""Process exit codes a scheduler can act on (standard library only)."""

EXIT_CORRUPTION = 87
"""Exit status of a training process that stopped because replicheck detected corruption.

Distinct from Python's 1 (uncaught exception), from 128+N (killed by signal N) and from
Slurm's and torchrun's own codes, so a scheduler prolog/epilog or the controller can tell a
detection from a crash.
"""

EXIT_SUSPECT_NODE = 86
"""Exit status of a training process that refused to start because an unresolved incident names
its node (``replicheck.elastic``); a launcher restart onto that node ends here instead of training."""
