# shellcheck shell=bash
# The step guard every TIDE batch script uses (sourced by slurm/tide_hetjob.sh, embedded in the
# scripts tide.cluster.script renders: a script Slurm copied to its spool must stand alone).
# One srun step over every het group, guarded. The last het group's ranks train, the others serve;
# rank 0 coordinates (and serves, unless it has a het group of its own). Each rank leaves its exit
# code in DIR/<rank>. If rank 0 fails, the step ends (srun gets TERM) and the job fails with its
# code; a serving instance (rank 1 .. of the serving group) that fails ends only itself, and a
# training rank that fails only degrades training: the coordinator goes on and decides the job's
# code. Once rank 0 has exited 0 (it waits for its instances), the ranks still running get
# TIDE_TRAIN_GRACE (60) s, then TERM. Slurm 22.05's srun can hang after all tasks of a het
# step have exited (mpi/pmix: srun joins its PMIx abort-agent thread once per het component), and
# then ignores TERM: it gets TIDE_STEP_GRACE (10) s to return once every rank is done, 3 times that
# once it got TERM, and is then killed. After SECS seconds (0 = never) srun gets TERM.
# A training component that failed while serving goes on is started again, TIDE_TRAIN_RESTARTS (0)
# times at most, TIDE_TRAIN_RESTART_S (30) s after it was lost: a step of its own on the last het group
# (--overlap: the first step still holds the resources), running COMMAND --rejoin, which joins the
# coordinator (tide.runtime.rejoin). Once the first step has ended it gets TIDE_STEP_GRACE s to
# exit, then TERM, and KILL as long again later.
tide_step() {  # tide_step SECS DIR SRUN [OPTIONS...] -- COMMAND...
  local secs=$1 grace=${TIDE_STEP_GRACE:-10} linger=${TIDE_TRAIN_GRACE:-60} t=0 n=0 n0 f r c v rc
  local restarts=${TIDE_TRAIN_RESTARTS:-0} delay=${TIDE_TRAIN_RESTART_S:-30} again=-1 jpid=0
  local all=-1 served=-1 stop=-1 srun=() jsrun=() code=() last=0
  export TIDE_STEP_DIR=$2
  shift 2
  while [[ $1 != -- ]]; do srun+=("$1"); shift; done
  shift
  for v in ${!SLURM_NTASKS_HET_GROUP_*}; do n=$((n + ${!v})); ((${v##*_} > last)) && last=${v##*_}; done
  for v in "${srun[@]}"; do [[ $v == --het-group=* ]] && v=--het-group=$last; jsrun+=("$v"); done
  jsrun+=(--overlap)
  ((n)) || n=${SLURM_NTASKS:-1}
  v=SLURM_NTASKS_HET_GROUP_$last
  n0=$((last ? n - ${!v} : n))  # ranks below n0 serve or coordinate, the others train
  mkdir -p "$TIDE_STEP_DIR"
  rm -rf "${TIDE_STEP_DIR:?}"/*  # a requeued job runs again under the same id: the last run's exit codes do not count
  # each rank in a session (process group) of its own, killed once the rank has exited: a child that
  # outlives it (a vLLM engine or worker process whose parent was killed) would run on, unseen. TERM
  # and USR2 (srun stopped, or Slurm's warning before the time limit) reach the rank's whole session:
  # serving stops taking requests and writes its results
  local wrap='setsid "$@" & p=$!; trap "kill -TERM -- -$p 2>/dev/null" TERM
    trap "kill -USR2 -- -$p 2>/dev/null" USR2
    while wait $p; rc=$?; ((rc > 128)) && kill -0 $p 2>/dev/null; do :; done; kill -KILL -- -$p 2>/dev/null
    f=$TIDE_STEP_DIR/$SLURM_PROCID; echo $rc >"$f.tmp"; mv "$f.tmp" "$f"; exit $rc'
  "${srun[@]}" bash -c "$wrap" rank "$@" &
  local pid=$!
  while
    for f in "$TIDE_STEP_DIR"/*; do  # ranks that exited since the last look
      r=${f##*/}
      [[ $r =~ ^[0-9]+$ && -z ${code[r]:-} ]] || continue
      c=$(<"$f")
      code[r]=$c
      if ((c && r == 0)); then
        echo "tide: rank 0 (the coordinator) exited $c: stopping the job" >&2
        ((stop >= 0)) || { kill -TERM "$pid" 2>/dev/null; stop=$t; }
      elif ((c && r < n0)); then
        echo "tide: serving instance $r exited $c: the other instances go on" >&2
      elif ((c)); then
        echo "tide: training rank $r exited $c: training degraded, serving goes on" >&2
        ((restarts > 0 && again < 0 && !jpid)) && again=$((t + delay))
      fi
    done
    if ((jpid)) && ! kill -0 "$jpid" 2>/dev/null; then  # the training component started again has ended
      wait "$jpid"
      c=$?
      jpid=0
      echo "tide: the training component started again exited $c" >&2
      ((c && restarts > 0)) && again=$((t + delay))
    fi
    if ((again >= 0 && t >= again && stop < 0 && served < 0)); then
      restarts=$((restarts - 1))
      again=-1
      echo "tide: starting the training component again (at most $restarts more time(s))" >&2
      mkdir -p "$TIDE_STEP_DIR/rejoin"
      TIDE_STEP_DIR=$TIDE_STEP_DIR/rejoin "${jsrun[@]}" bash -c "$wrap" rank "$@" --rejoin &
      jpid=$!
    fi
    kill -0 "$pid" 2>/dev/null
  do
    ((all < 0 && ${#code[@]} >= n)) && all=$t
    ((served < 0 && ${code[0]:-1} == 0)) && served=$t
    if ((all >= 0 && t - all >= grace)); then
      echo "tide: the ranks are done, srun did not return (Slurm het-step hang): killing it" >&2
      kill -KILL "$pid"
      break
    elif ((stop >= 0 && t - stop >= 3 * grace)); then
      echo "tide: srun still running $((3 * grace)) s after TERM: killing it" >&2
      kill -KILL "$pid"
      break
    elif ((stop < 0 && served >= 0 && t - served >= linger)); then
      echo "tide: serving is done, ranks still running after $linger s: stopping them" >&2
      kill -TERM "$pid"
      ((jpid)) && kill -TERM "$jpid" 2>/dev/null
      stop=$t
    elif ((stop < 0 && secs > 0 && t >= secs)); then
      echo "tide: srun still running after $secs s: stopping it" >&2
      kill -TERM "$pid"
      stop=$t
    fi
    sleep 1
    t=$((t + 1))
  done
  wait "$pid" 2>/dev/null
  rc=$?
  if ((jpid)); then  # the training component started again: the coordinator's Shutdown ends it, else TERM, KILL
    for ((c = 0; c < 2 * grace && jpid; c++)); do
      ((c == grace)) && kill -TERM "$jpid" 2>/dev/null
      if kill -0 "$jpid" 2>/dev/null; then sleep 1; else jpid=0; fi
    done
    ((jpid)) && kill -KILL "$jpid" 2>/dev/null
    wait 2>/dev/null
  fi
  [[ -n ${code[0]:-} ]] && rc=${code[0]}  # the coordinator's code decides
  rm -rf "$TIDE_STEP_DIR"
  return "$rc"
}
