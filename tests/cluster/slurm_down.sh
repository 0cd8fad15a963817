#!/usr/bin/env bash
# Stop the cluster started by slurm_up.sh: cancel its jobs, then stop each daemon by the PID recorded
# under STATE_DIR (the slurm daemons together, then munged; SIGKILL after 10 s). Never by name: other
# Slurm or munge daemons on this machine are left alone. Logs stay in STATE_DIR/log.
#
#   tests/cluster/slurm_down.sh [STATE_DIR]      (default /tmp/tide-slurm)
set -uo pipefail
STATE=$(realpath -m "${1:-/tmp/tide-slurm}")
export SLURM_CONF=$STATE/etc/slurm.conf

stop() {  # stop PIDFILE...: TERM to all at once (each takes 1-2 s), wait, KILL after 10 s
  local f pid pids=() i
  for f in "$@"; do
    # a stale file's PID may belong to someone else by now: only ours by name
    [[ -s $f ]] && pid=$(cat "$f") && [[ $(cat "/proc/$pid/comm" 2>/dev/null) =~ ^(slurmd|slurmctld|munged)$ ]] &&
      kill "$pid" 2>/dev/null && pids+=("$pid")
    rm -f "$f"
  done
  for pid in "${pids[@]}"; do
    for i in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && { echo "slurm_down: pid $pid ignored SIGTERM, killing" >&2; kill -9 "$pid"; }
  done
  return 0
}

if [[ -s $STATE/run/slurmctld.pid ]] && kill -0 "$(cat "$STATE/run/slurmctld.pid")" 2>/dev/null; then
  jobs=$(timeout 10 squeue -h -o %A 2>/dev/null | sort -u)
  # shellcheck disable=SC2086  # one argument per job id
  [[ -n $jobs ]] && timeout 10 scancel $jobs && sleep 1
fi
stop "$STATE"/run/slurmd-*.pid "$STATE/run/slurmctld.pid"
stop "$STATE/munge/munged.pid"  # last: the slurm daemons authenticate through it until they exit
echo "slurm_down: stopped; logs in $STATE/log"
