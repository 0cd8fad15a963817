#!/bin/bash
# TIDE as one Slurm heterogeneous job, without Python on the submit side:
#
#   sbatch slurm/tide_hetjob.sh CONFIG [OUTDIR]          (from the repository root)
#
# Component 0 serves, component 1 trains the EAGLE-3 draft; one `srun --het-group=0,1 --mpi=pmix` step
# runs `python -m tide.runtime --config CONFIG --out OUTDIR` on every rank of both, in ONE
# MPI_COMM_WORLD (component 0's ranks first). Edit the #SBATCH lines for your site; options given to
# sbatch override them per component: `sbatch [opts of 0] : [opts of 1] slurm/tide_hetjob.sh CONFIG`.
# A config with `slurm.coordinator` gives the coordinator a component of its own, first: then give three
# on the command line, each in full (these #SBATCH lines fill in by position what one leaves out):
# `sbatch -p cpu -N 1 --ntasks-per-node=1 --gpus-per-node=0 --cpus-per-task=2 : [serving] : [training] ...`.
# The batch log goes to tide-<jobid>.out/.err in the submit directory, every line labelled by rank.
# Near the time limit the step guard stops srun (TIDE_SRUN_TIMEOUT, from the time actually left, so
# it follows an --time given to sbatch); srun passes the TERM to every rank: serving drains and writes
# its results. (Scripts rendered from a config also ask Slurm for --signal, sized from its time.)
#
# Environment (read at run time; sbatch passes the submitting shell's environment on):
#   TIDE_PYTHON        python on the compute nodes (default: ./.venv/bin/python, else python3)
#   TIDE_OUT           OUTDIR when not given as the second argument (default runs/slurm-<jobid>)
#   TIDE_SRUN_TIMEOUT  seconds before srun is stopped (default: the job's time left minus 60 s)
#   TIDE_STEP_GRACE    seconds srun may take to return once every rank has exited (default 10)
#   TIDE_TRAIN_GRACE   seconds training ranks may run on once serving is done (default 60)
#   TIDE_TRAIN_RESTARTS  times a lost training component is started again in the job (default 3)
#   TIDE_TRAIN_RESTART_S seconds after the loss that it starts again (default 30)
#   TIDE_CMD           replaces the whole command (a shell command line; tests run an MPI probe)
#   TIDE_HOME          the repository (default: the submit directory, which must be its root)
#
#SBATCH --job-name=tide
#SBATCH --output=tide-%j.out
#SBATCH --error=tide-%j.err
# a requeued run resumes from its newest draft and stored rows, and appends to the logs
#SBATCH --requeue
#SBATCH --open-mode=append
# ---- component 0 (het group 0): serving, H100 nodes, one rank (one vLLM engine) on one GPU
#SBATCH --time=02:00:00
#SBATCH --partition=h100
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH hetjob
# ---- component 1 (het group 1): draft training, MI250 nodes, one rank per GPU
#SBATCH --time=02:00:00
#SBATCH --partition=mi250
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=8
set -uo pipefail

CONFIG=${1:?usage: sbatch slurm/tide_hetjob.sh CONFIG [OUTDIR]}
OUT=${2:-${TIDE_OUT:-runs/slurm-$SLURM_JOB_ID}}
PY=${TIDE_PYTHON:-.venv/bin/python}
[[ -x $PY ]] || PY=python3

# Seconds left in the allocation ([D-]HH:MM:SS, MM:SS or UNLIMITED) minus 60, for the script to report.
left_s() {
  local t d=0 s=0 x
  t=$(squeue -h -j "$SLURM_JOB_ID" -o %L 2>/dev/null | head -1)
  [[ $t =~ ^[0-9:-]+$ ]] || { echo 0; return; }
  [[ $t == *-* ]] && { d=${t%%-*}; t=${t#*-}; }
  IFS=: read -ra parts <<<"$t"
  for x in "${parts[@]}"; do s=$((s * 60 + 10#$x)); done
  s=$((d * 86400 + s - 60))
  echo $((s > 60 ? s : 60))
}
TIMEOUT=${TIDE_SRUN_TIMEOUT:-$(left_s)}  # 0 = no limit

if [[ -n ${TIDE_CMD:-} ]]; then
  CMD=(bash -c "$TIDE_CMD")
  export TIDE_TRAIN_RESTARTS=0  # a probe has no training component to start again
else
  export TIDE_TRAIN_RESTARTS=${TIDE_TRAIN_RESTARTS:-3}
  CMD=("$PY" -m tide.runtime --config "$CONFIG" --out "$OUT")
fi
mkdir -p "$OUT"
OUT=$(realpath "$OUT")  # ranks on other nodes share it, not our working directory's meaning
export PYTHONUNBUFFERED=1

# The step guard (tide_step): serving ranks decide the job's code, a failed training rank only
# degrades training, srun's het-step hang is cut short (its own comments say how).
# shellcheck source=../tide/cluster/tide_step.sh
source "${TIDE_HOME:-$SLURM_SUBMIT_DIR}/tide/cluster/tide_step.sh" || exit 1

# Three components (sbatch [opts] : [opts] : [opts]): the first is a coordinator of its own (the
# config's `slurm.coordinator`), then serving and training.
G=$((${SLURM_HET_SIZE:-2} - 2))  # the serving group
where() { local n=SLURM_JOB_NODELIST_HET_GROUP_$1 p=SLURM_JOB_PARTITION_HET_GROUP_$1; echo "${!n} (${!p})"; }
echo "tide: job $SLURM_JOB_ID: $( ((G)) && echo "coordinator on $(where 0), ")serving on $(where "$G")," \
  "training on $(where $((G + 1))); out $OUT; srun timeout ${TIMEOUT}s"
tide_step "$TIMEOUT" "$OUT/.step-$SLURM_JOB_ID" srun --het-group="$(seq -s, 0 $((G + 1)))" --mpi=pmix --label \
  -- "${CMD[@]}"
