#!/usr/bin/env bash
# Several `mambakit task` runs side by side on one GPU, in one device call:
#   TASK_RUNS=$'ih-a induction-heads --lr 5e-3\nsc-a selective-copying --lr 1e-3' \
#     bash scripts/task_sweep.sh
# Each line of TASK_RUNS is "NAME TASK FLAGS...". The runs live in $RUNS (default
# /tmp/task_runs; pass a folder carried to the device, with --resume in the flags, to
# train on). Back under $OUT: task_sweep.log (the tail of each run's log) and
# task_runs.tar.gz (every run's accuracy.json, metrics and checkpoints), two files in all.
# The exit status is that of the first run that failed (0 when all succeeded).
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mambakit_out}
RUNS=${RUNS:-/tmp/task_runs}
mkdir -p "$OUT" "$RUNS"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/task_sweep.log" 2>&1
t0=$(date +%s)
names=() pids=()
while read -r name task flags; do
  [ -n "$name" ] || continue
  # shellcheck disable=SC2086  # flags split into words on purpose
  timeout "${T_TASK:-560}" python -m mambakit task "$task" --device "${DEVICE:-cuda}" \
    --runs-dir "$RUNS" --name "$name" --no-progress $flags > "$RUNS/$name.log" 2>&1 &
  names+=("$name") pids+=($!)
done <<< "${TASK_RUNS:?TASK_RUNS: one line per run, NAME TASK FLAGS...}"
status=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"
  rc=$?
  [ "$rc" -eq 0 ] || { [ "$status" -ne 0 ] || status=$rc; echo "${names[$i]}: exit $rc"; }
done
for name in "${names[@]}"; do
  { echo "== $name"; grep -v "^step " "$RUNS/$name.log" | tail -n 40; } >> "$OUT/task_sweep.log"
done
echo "wall: $(( $(date +%s) - t0 )) s" >> "$OUT/task_sweep.log"
tar czf "$OUT/task_runs.tar.gz" -C "$RUNS" .
cat "$OUT/task_sweep.log"
exit "$status"
