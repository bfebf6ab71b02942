"""The step and its verdict: :class:`~replicheck.guard.step.guard.Guard`, its passes, replays,
judge, failure protocol and incident. Imports no specific parallelism (an import-linter contract)."""
