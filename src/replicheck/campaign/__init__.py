"""Whole-job detection campaigns and the clean soak: scenarios, runner, report and plots.

Drives guarded jobs with faults from ``replicheck.faults`` and measures what was detected.
"""
