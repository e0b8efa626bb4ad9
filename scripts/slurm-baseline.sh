#!/usr/bin/env bash
# Runs a command next to a one-node Slurm cluster on 127.0.0.1, for the dispatch
# benchmark's `srun true` baseline (docs/benchmarks.md, dispatch), e.g.
#
#   scripts/slurm-baseline.sh target/release/testnet bench dispatch --runs 50
#
# Installs Slurm and MUNGE from Debian packages when they are missing (root), starts
# munged (unless one runs already), slurmctld and slurmd from a configuration in a
# temporary directory (ports 16817 and 16818, no accounting, no cgroups, backfill
# scheduling as Slurm ships it), waits until the node is idle, runs the command with
# SLURM_CONF pointing there, and stops every daemon it started when the command ends.
set -euo pipefail

if [ "$#" -eq 0 ]; then
  echo "usage: $0 COMMAND [ARGS...]" >&2
  exit 2
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "run as root: Slurm's daemons run as root here, munged as user munge" >&2
  exit 1
fi
# srun and slurmd reach each other at the address this host's name resolves to: keep
# every packet on loopback.
if ! getent hosts "$(hostname)" | grep -q '^127\.'; then
  echo "$(hostname) does not resolve to a loopback address, so Slurm would talk over the network; not started" >&2
  exit 1
fi

if ! command -v slurmctld >/dev/null 2>&1 || ! command -v slurmd >/dev/null 2>&1 \
  || ! command -v srun >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "please install Slurm (slurmctld, slurmd, srun) and MUNGE" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmd slurmctld slurm-client munge >/dev/null
fi

dir=$(mktemp -d /tmp/gpunode-slurm.XXXXXX)
munge_pid_file=/run/munge/gpunode-bench.pid
started_munge=0
pids=()
cleanup() {
  if [ "$started_munge" -eq 1 ] && [ -s "$munge_pid_file" ]; then
    pids+=("$(cat "$munge_pid_file")")
  fi
  for pid in "${pids[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
  for pid in "${pids[@]}"; do
    for _ in $(seq 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
      kill -9 "$pid" 2>/dev/null || true
    fi
  done
  if [ "$started_munge" -eq 1 ]; then
    rm -f "$munge_pid_file"
  fi
  rm -rf "$dir"
}
trap cleanup EXIT

# MUNGE authenticates Slurm's messages; the package creates its key and user.
if ! munge -n >/dev/null 2>&1; then
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
  started_munge=1
  su -s /bin/sh munge -c "/usr/sbin/munged --pid-file=$munge_pid_file"
fi

mkdir -p "$dir/state" "$dir/spool"
cpus=$(nproc)
cat >"$dir/slurm.conf" <<EOF
ClusterName=gpunodebench
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=root
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=bench Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF="$dir/slurm.conf"

slurmctld -D -i -f "$SLURM_CONF" >"$dir/slurmctld.out" 2>&1 &
pids+=("$!")
slurmd -D -f "$SLURM_CONF" >"$dir/slurmd.out" 2>&1 &
pids+=("$!")

node_idle() {
  [ -n "$(sinfo -h -r -t idle -o %N 2>/dev/null)" ]
}
for _ in $(seq 100); do
  node_idle && break
  sleep 0.2
done
if ! node_idle; then
  echo "the Slurm node did not come up; logs:" >&2
  cat "$dir"/*.out "$dir"/*.log >&2 2>/dev/null || true
  exit 1
fi

"$@"
