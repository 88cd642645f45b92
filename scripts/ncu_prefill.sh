#!/usr/bin/env bash
# Hardware counters of the prefill scan (both passes of the first layer) at the presets'
# shapes, 1 x 4096 bf16: issue, pipes, stalls, occupancy. Writes $OUT/ncu_prefill_<preset>.txt.
#   run(command="bash scripts/ncu_prefill.sh 130m 1.4b")
set -uo pipefail
export PYTHONPATH=src
OUT=${OUT:-/tmp/mambakit_out}
mkdir -p "$OUT"
METRICS=sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active
METRICS+=,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active
METRICS+=,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active
METRICS+=,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active
METRICS+=,sm__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active
for preset in "${@:-130m}"; do
  f="$OUT/ncu_prefill_$preset.txt"
  timeout ${T_NCU:-150} ncu --clock-control none -k "regex:${NCU_KERNEL:-^_fwd_kernel$}" -c ${NCU_COUNT:-2} \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section ComputeWorkloadAnalysis --section InstructionStats \
    --metrics "$METRICS" python scripts/prefill_once.py "$preset" 4096 > "$f" 2>&1
  echo "== ncu $preset"
  grep -E "_fwd_kernel|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issued Ipc|Issue Slots|Stall|No Eligible|Eligible Warps|Compute \(SM\)|Memory Throughput|pipe|issue_active|inst_executed.sum|Grid Size|Block Size" "$f" | head -80
done
