#!/usr/bin/env bash
# Training on this machine's GPUs through torchrun: one process (CUDA graph), DDP and FSDP2,
# each rank --batch-size 8 x --seqlen 2048 of 130m; the last metric line of each run
# (tokens/s over all ranks, peak memory of rank 0's GPU) goes to $OUT/dist_check.log.
#   run(command="bash scripts/dist_check.sh", kind="nvidia-h200-x2")
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mambakit_out}
mkdir -p "$OUT"
N=${N_GPUS:-$(nvidia-smi -L | wc -l)}
LOG="$OUT/dist_check.log"
echo "gpus: $N" | tee "$LOG"
for mode in ${MODES:-none ddp fsdp}; do
  nproc=$N
  [ "$mode" = none ] && nproc=1
  rm -rf "/tmp/runs/dist_$mode"
  timeout ${T_RUN:-240} torchrun --standalone --nproc_per_node "$nproc" -m mambakit train \
    --distributed "$mode" --preset ${PRESET:-130m} --batch-size ${BATCH:-8} --seqlen ${SEQLEN:-2048} \
    --steps ${STEPS:-40} --warmup-steps 10 --eval-every 0 --ckpt-minutes 0 --sample-tokens 0 \
    --no-progress --runs-dir /tmp/runs --name "dist_$mode" > "$OUT/dist_$mode.txt" 2>&1
  echo "== $mode on $nproc GPU(s): exit $?" | tee -a "$LOG"
  tail -3 "$OUT/dist_$mode.txt" | tee -a "$LOG"
  tail -1 "/tmp/runs/dist_$mode/metrics.jsonl" | tee -a "$LOG"
done
