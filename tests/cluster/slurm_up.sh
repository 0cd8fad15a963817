#!/usr/bin/env bash
# Start a one-machine "multi-node" Slurm cluster for TIDE's tests (Debian 12, slurm-wlm 22.05, root).
#
#   tests/cluster/slurm_up.sh [STATE_DIR]        (default /tmp/tide-slurm)
#
# 4 slurmd instances n[0-3] on 127.0.0.1 (a heterogeneous job needs at least two Slurm nodes, and is
# started only by the backfill scheduler), partitions gpu_infer=n[0-1] (serving, het group 0) and
# gpu_train=n[2-3] (training, het group 1), 2 fake GPUs per node. Everything - config, munge key and
# socket, spool, logs, PIDs - lives under STATE_DIR, so clients need only `SLURM_CONF`, printed last as
# `export SLURM_CONF=...`. No accounting daemon: sacct is disabled, job state comes from scontrol.
# Idempotent: installs only missing packages and returns at once when the cluster is already up.
# Ports: TIDE_SLURM_PORT (slurmctld, default 16817) and the next 4 (slurmd n0..n3).
set -euo pipefail
STATE=$(realpath -m "${1:-/tmp/tide-slurm}")
PORT=${TIDE_SLURM_PORT:-16817}
NODES=(n0 n1 n2 n3)
[[ $STATE != *[[:space:]]* ]] || { echo "slurm_up: state dir must not contain spaces: $STATE" >&2; exit 2; }
[[ $(id -u) == 0 ]] || { echo "slurm_up: run as root (daemons, mknod, apt)" >&2; exit 2; }
t0=$SECONDS
export SLURM_CONF=$STATE/etc/slurm.conf

alive() { [[ -s $1 ]] && [[ $(cat "/proc/$(cat "$1")/comm" 2>/dev/null) =~ ^(slurmd|slurmctld|munged)$ ]]; }
all_alive() {
  alive "$STATE/munge/munged.pid" && alive "$STATE/run/slurmctld.pid" || return 1
  for n in "${NODES[@]}"; do alive "$STATE/run/slurmd-$n.pid" || return 1; done
}
wait_idle() {  # all 4 nodes idle, or fail with where to look
  for _ in $(seq 1 120); do
    [[ $(sinfo -h -o '%D %T' 2>/dev/null | tr -s ' ') == "4 idle" ]] && return 0
    sleep 0.25
  done
  sinfo -N >&2 || true
  echo "slurm_up: nodes not idle after 30 s; logs in $STATE/log" >&2
  return 1
}
report() {
  sinfo -o '%P %D %T %N %G'
  echo "slurm_up: up in $((SECONDS - t0)) s; logs in $STATE/log"
  echo "export SLURM_CONF=$SLURM_CONF"
}

if all_alive && sinfo -h >/dev/null 2>&1; then report; exit 0; fi  # up (maybe running jobs)
in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
if ! alive "$STATE/run/slurmctld.pid"; then  # else half up: the ports are ours
  for p in $(seq "$PORT" $((PORT + 4))); do
    in_use "$p" && { echo "slurm_up: port $p is taken (another cluster?); choose TIDE_SLURM_PORT" >&2; exit 2; }
  done
fi

# ---- packages (only the missing ones; ~15 s the first time)
PKGS=(slurmctld slurmd slurm-client munge openmpi-bin)
missing=()
for p in "${PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  echo "slurm_up: apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Slurm's mpi/pmix plugin dlopen()s the unversioned libpmix.so, which only libpmix-dev ships (with
# autotools in tow); without it srun --mpi=pmix fails with "can not load PMIx library".
pmix_lib=$(dpkg -L libpmix2 | grep '/pmix2/lib/libpmix\.so\.2$' | head -1)
[[ -e ${pmix_lib%.2} ]] || ln -s libpmix.so.2 "${pmix_lib%.2}"
HOST=$(hostname -s)  # slurmd matches NodeHostname against gethostname(), which must resolve
getent hosts "$HOST" >/dev/null || echo "127.0.0.1 $HOST" >>/etc/hosts

# ---- files
mkdir -p "$STATE"/{etc,munge,log/munge,run,fakegpu,spool/ctld}
for n in "${NODES[@]}"; do mkdir -p "$STATE/spool/$n" "$STATE/tmp/$n"; done
# Fake GPUs must be character devices: for a plain file slurmd logs "not a valid character or block
# device" and never sets CUDA_VISIBLE_DEVICES. 195 is the NVIDIA major; nothing opens them.
for i in 0 1; do [[ -c $STATE/fakegpu/nvidia$i ]] || mknod "$STATE/fakegpu/nvidia$i" c 195 "$i"; done

cat >"$STATE/etc/slurm.conf" <<EOF
ClusterName=tide-ci
SlurmctldHost=${HOST}(127.0.0.1)
SlurmctldPort=${PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=${STATE}/munge/munge.socket
StateSaveLocation=${STATE}/spool/ctld
SlurmdSpoolDir=${STATE}/spool/%n
SlurmctldPidFile=${STATE}/run/slurmctld.pid
SlurmdPidFile=${STATE}/run/slurmd-%n.pid
SlurmctldLogFile=${STATE}/log/slurmctld.log
SlurmdLogFile=${STATE}/log/slurmd-%n.log
# PMIx puts \$TmpFS/spmix_appdir_<uid>_<jobid>.<step> there; het components share the leader's job
# id, so on one host each fake node needs its own directory.
TmpFS=${STATE}/tmp/%n
TaskProlog=${STATE}/etc/task_prolog.sh
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
# Het jobs are started only by backfill, every bf_interval seconds (default 30).
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
MpiDefault=none
ReturnToService=2
MailProg=/bin/true
SlurmdParameters=config_overrides
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
# Finished jobs stay visible to scontrol for 10 min (no accounting to ask afterwards).
MinJobAge=600
NodeName=n[0-3] NodeHostname=${HOST} NodeAddr=127.0.0.1 Port=[$((PORT + 1))-$((PORT + 4))] CPUs=4 Sockets=1 CoresPerSocket=4 ThreadsPerCore=1 RealMemory=4000 Gres=gpu:2 State=UNKNOWN
PartitionName=gpu_infer Nodes=n[0-1] Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu_train Nodes=n[2-3] MaxTime=INFINITE State=UP
EOF
cat >"$STATE/etc/gres.conf" <<EOF
AutoDetect=off
NodeName=n[0-3] Name=gpu File=${STATE}/fakegpu/nvidia[0-1]
EOF
# Open MPI's shared-memory BTL names its /dev/shm segments by host, job and local rank, so ranks of
# n0 and n2 (same host) collide and crash; one backing directory per fake node avoids that. All fake
# nodes share this machine's cores: a training rank (gpu_train: n2, n3) gets one thread, which leaves a core
# to vLLM's engine (it binds its threads itself) instead of both spinning on the same one.
cat >"$STATE/etc/task_prolog.sh" <<EOF
#!/bin/sh
echo "export OMPI_MCA_btl_vader_backing_directory=${STATE}/tmp/\$SLURMD_NODENAME"
EOF
chmod 755 "$STATE/etc/task_prolog.sh"

# ---- munge (own key and socket; munged runs as the munge user, who must own its files)
runuser -u munge -- test -x "$STATE" ||
  { echo "slurm_up: the munge user cannot reach $STATE (a parent dir is not world-executable)" >&2; exit 2; }
[[ -s $STATE/munge/munge.key ]] || mungekey --create --keyfile="$STATE/munge/munge.key" >/dev/null
chown -R munge:munge "$STATE/munge" "$STATE/log/munge" && chmod 711 "$STATE/munge" && chmod 400 "$STATE/munge/munge.key"
if ! alive "$STATE/munge/munged.pid"; then
  runuser -u munge -- /usr/sbin/munged --socket="$STATE/munge/munge.socket" \
    --key-file="$STATE/munge/munge.key" --pid-file="$STATE/munge/munged.pid" \
    --seed-file="$STATE/munge/munged.seed" --log-file="$STATE/log/munge/munged.log"
fi
munge -n --socket="$STATE/munge/munge.socket" | unmunge --socket="$STATE/munge/munge.socket" >/dev/null

# ---- slurmctld (-c: start from a clean state) and one slurmd per fake node
alive "$STATE/run/slurmctld.pid" || /usr/sbin/slurmctld -c -f "$SLURM_CONF"
for n in "${NODES[@]}"; do alive "$STATE/run/slurmd-$n.pid" || /usr/sbin/slurmd -N "$n" -f "$SLURM_CONF"; done
wait_idle
report
