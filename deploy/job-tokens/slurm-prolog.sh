#!/bin/sh
# PrologSlurmctld (runs as SlurmUser on the slurmctld host at job start): give job
# $SLURM_JOB_ID a token that speaks only for itself. The controller's --job-token-file is
# $TOKENS (a directory, re-read when it changes); the job reads its copy from
# $JOBS/$SLURM_JOB_ID.token (set REPLICHECK_JOB_TOKEN_FILE to it in the job script).
set -eu
TOKENS=${REPLICHECK_TOKEN_DIR:-/etc/replicheck/job-tokens}
JOBS=${REPLICHECK_JOB_TOKEN_SHARE:-/shared/replicheck/job-tokens}
case "$SLURM_JOB_ID" in *[!0-9]*|'') exit 0 ;; esac
secret=$(head -c 32 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n')
umask 077
printf '%s\n' "$secret" > "$JOBS/.$SLURM_JOB_ID.tmp"
chown "$SLURM_JOB_USER" "$JOBS/.$SLURM_JOB_ID.tmp"
chmod 0400 "$JOBS/.$SLURM_JOB_ID.tmp"
mv "$JOBS/.$SLURM_JOB_ID.tmp" "$JOBS/$SLURM_JOB_ID.token"
printf 'slurm-%s %s jobs=%s\n' "$SLURM_JOB_ID" "$secret" "$SLURM_JOB_ID" > "$TOKENS/.$SLURM_JOB_ID.tmp"
mv "$TOKENS/.$SLURM_JOB_ID.tmp" "$TOKENS/$SLURM_JOB_ID"
