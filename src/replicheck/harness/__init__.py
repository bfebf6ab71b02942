"""The proof harness: a local multi-process launcher, the demo's workload, and a guarded job.

Used by the demo, the campaign and the tests; a training job of a user's never imports it.
"""
