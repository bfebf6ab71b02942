#!/usr/bin/env bash
# System packages the test suite needs (a real Slurm for tests/slurm, with job accounting:
# slurmdbd on a MariaDB server the tests start privately; Debian's Chromium and its
# driver for the approval page test in tests/http, since browsers cannot be downloaded there).
# Installs them with apt when running as root and they are missing; otherwise says what is missing.
set -euo pipefail
need=()
command -v slurmctld >/dev/null 2>&1 || need+=(slurmctld)
command -v slurmd >/dev/null 2>&1 || need+=(slurmd)
command -v sbatch >/dev/null 2>&1 || need+=(slurm-client)
command -v munged >/dev/null 2>&1 || need+=(munge)
command -v slurmdbd >/dev/null 2>&1 || need+=(slurmdbd)
# The tests run their own mariadbd (private datadir and port); the package's service is not used.
command -v mariadbd >/dev/null 2>&1 || need+=(mariadb-server)
command -v mariadb-admin >/dev/null 2>&1 || need+=(mariadb-client)
[ -x /usr/bin/chromium ] || need+=(chromium)
[ -x /usr/bin/chromedriver ] || need+=(chromium-driver)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "system-deps: not root; missing ${need[*]} (the Slurm and browser tests will say so)" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
# The tests start their own munged, slurmdbd, MariaDB, slurmctld and slurmd: keep the packages
# from starting their system services during the install (policy-rc.d "101": action forbidden).
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
  chmod 755 /usr/sbin/policy-rc.d
  trap 'rm -f /usr/sbin/policy-rc.d' EXIT
fi
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
