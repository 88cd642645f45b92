#!/usr/bin/env bash
# The small recurrent models' device check in one call (issue: the RL step and window):
#   run(command="bash scripts/rl_device_check.sh", carry=[".wheels"], timeout_s=600)
# .wheels (optional) holds numba and llvmlite wheels for the device's Python (pip download
# ... -d .wheels), installed where the image has no numba: without it the CPU rows time the
# PyTorch bodies, not the compiled paths a user with mambakit[cpu] gets. STAGES picks the
# stages.
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mambakit_out}
mkdir -p "$OUT"
STAGES=${STAGES:-"step threads cpu"}
stage() { case " $STAGES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
if ! python -c "import numba" 2>/dev/null && ls .wheels/*.whl >/dev/null 2>&1; then
  python -m pip install -q --no-index --no-deps --target /tmp/jit .wheels/*.whl 2>&1 | tail -2
  export PYTHONPATH=src:/tmp/jit
fi
python -c "import numba, numpy, torch; print('numba', numba.__version__, 'numpy', numpy.__version__, 'torch', torch.__version__)"
if stage step; then  # the CUDA step: bench_rl's figure beside the profile's loop, one process
  timeout ${T_STEP:-120} python scripts/rl_step_profile.py --mixers mamba1 mamba3 --batches 1 \
    --built on --no-profile --bench-rl 2>&1 | grep -v Warn | tee "$OUT/rl_step.txt"
fi
if stage threads; then  # the CPU window's time by thread count
  timeout ${T_THREADS:-240} python scripts/rl_cpu_threads.py --mixers mamba3 mamba1 \
    --batches 1 4 16 64 --passes 4 --reps 8 --profile 16 ${THREADS_ARGS:-} 2>&1 | grep -v USDT \
    | tee "$OUT/rl_threads.txt"
fi
if stage pools; then  # the batch-1 window at torch's and numba's counts set apart
  for spin in ${POOLS_SPINS:-""}; do
    timeout ${T_POOLS:-120} python scripts/rl_cpu_pools.py ${spin:+--numba-spin $spin} \
      ${POOLS_ARGS:-} 2>&1 | tee -a "$OUT/rl_pools.txt"
  done
fi
if stage cpu; then  # bench_rl's CPU rows
  timeout ${T_CPU:-200} python benchmarks/bench_rl.py --device cpu --mixers mamba3 mamba1 \
    --out "$OUT/bench_rl_cpu.json" ${CPU_ARGS:-} 2>&1 | grep -v "^{" | tee "$OUT/bench_rl_cpu.txt"
fi
if stage both; then  # the whole benchmark, CPU and CUDA
  timeout ${T_BOTH:-330} python benchmarks/bench_rl.py --device both --out "$OUT/bench_rl.json" \
    ${BOTH_ARGS:-} 2>&1 | grep -v "^{" | tee "$OUT/bench_rl.txt"
fi
