#!/bin/sh
# EpilogSlurmctld (at job end): the job's token stops working. The incident a job writes as it
# exits (exit 87) is posted before this runs; its allocation is still checked through sacct.
set -eu
TOKENS=${REPLICHECK_TOKEN_DIR:-/etc/replicheck/job-tokens}
JOBS=${REPLICHECK_JOB_TOKEN_SHARE:-/shared/replicheck/job-tokens}
case "$SLURM_JOB_ID" in *[!0-9]*|'') exit 0 ;; esac
rm -f "$TOKENS/$SLURM_JOB_ID" "$JOBS/$SLURM_JOB_ID.token"
