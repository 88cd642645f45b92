#!/usr/bin/env bash
# The whole GPU check in one device call:
#   run(command="bash scripts/gpu_check.sh", timeout_s=600)
# GPU tests, then the benchmarks; everything lands under $OUT (at most 8 files come back).
# STAGES picks the stages, e.g. STAGES="tests scan" (default: the list below).
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mambakit_out}
mkdir -p "$OUT"
STAGES=${STAGES:-"sweep conv dtproj scan model tests train decode dprofile"}
# opt-in stages: optim savetiles model14 model3 model14m3 m3layer residual rms ncu tasks m3 m3step m3fwd m2 m2fwd serve servepack serveprof servetl servehold serveflight serveprobe packprobe rl rlprof gemmprobe prefillhost stepsweep
LOG="$OUT/gpu_check.log"
{
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,driver_version --format=csv
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$LOG"
# the peer (mamba_ssm, causal_conv1d), when the call carries .peers (../shared/peers/README.md)
if ls .peers/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/peers .peers/*.whl 2>&1 | tail -2
  export PYTHONPATH=src:/tmp/peers
fi
stage() { case " $STAGES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
if stage sweep; then  # timings only: later stages run the library's own config (kernels.config)
  echo "== scan_sweep" | tee -a "$LOG"
  timeout ${T_SWEEP:-240} python scripts/scan_sweep.py --out "$OUT/scan_sweep.json" ${SWEEP_ARGS:-} 2>&1 | tee -a "$LOG"
fi
if stage conv; then  # the conv kernels' launch parameters, and the peer's causal_conv1d
  echo "== conv_sweep" | tee -a "$LOG"
  timeout ${T_CONV:-120} python scripts/conv_sweep.py --out "$OUT/conv_sweep.json" ${CONV_ARGS:-} 2>&1 | tee -a "$LOG"
fi
if stage dtproj; then  # the dt_proj kernel (softplus in its epilogue) against the chain, its launch parameters
  echo "== dt_proj_sweep" | tee -a "$LOG"
  timeout ${T_DTPROJ:-150} python scripts/dt_proj_sweep.py --out "$OUT/dt_proj_sweep.json" 2>&1 | tee -a "$LOG"
fi
if stage residual; then  # out_proj + the next add & norm: chained, or the GEMM adding into the residual
  echo "== residual_sweep" | tee -a "$LOG"
  timeout ${T_RESIDUAL:-90} python scripts/residual_sweep.py --out "$OUT/residual_sweep.json" 2>&1 | tee -a "$LOG"
fi
if stage rms; then  # the RMSNorm forward's tiles at the prefill shapes
  echo "== rms_sweep" | tee -a "$LOG"
  timeout ${T_RMS:-90} python scripts/rms_sweep.py --out "$OUT/rms_sweep.json" 2>&1 | tee -a "$LOG"
fi
if stage ncu; then  # hardware counters of the scan kernels (stall reasons, occupancy); Mamba-3:
  # NCU_PROG="scripts/m3_chunk_sweep.py --once" NCU_KERNELS=_chunk_grad_kernel
  echo "== ncu" | tee -a "$LOG"
  for k in ${NCU_KERNELS:-_bwd_kernel _fwd_kernel}; do
    timeout ${T_NCU:-120} ncu --clock-control none -k "regex:^$k\$" -c ${NCU_COUNT:-1} --section SpeedOfLight \
      --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis ${NCU_SECTIONS:-} \
      python ${NCU_PROG:-scripts/scan_sweep.py --once} > "$OUT/ncu$k.txt" 2>&1
    grep -E "Duration|Registers|Achieved Occupancy|Theoretical Occupancy|Issued Ipc|Issue Slots|Stall|No Eligible|Warp Cycles|Eligible Warps|Memory Throughput|Compute \(SM\)|Pipe|XU|FMA" "$OUT/ncu$k.txt" | head -${NCU_LINES:-40} | tee -a "$LOG"
  done
fi
if stage tasks; then  # both synthetic tasks side by side, the CLI's CUDA defaults, to 2^20
  echo "== tasks" | tee -a "$LOG"
  M=${TASK_MINUTES:-7}  # training minutes each (the test to 2^20 takes under a minute more)
  TASK_RUNS="induction-heads induction-heads --max-minutes $M ${TASK_ARGS:-}
selective-copying selective-copying --max-minutes $M ${TASK_ARGS:-}" \
    T_TASK=${T_TASK:-$(awk "BEGIN { print int($M * 60 + 150) }")} bash scripts/task_sweep.sh 2>&1 | grep -v "^  length" | tail -60 | tee -a "$LOG"
fi
if stage scan; then
  echo "== bench_scan" | tee -a "$LOG"
  timeout ${T_SCAN:-150} python benchmarks/bench_scan.py --out "$OUT/bench_scan.json" ${SCAN_ARGS:-} 2>&1 | tee -a "$LOG"
fi
if stage model; then
  echo "== bench_model" | tee -a "$LOG"
  timeout ${T_MODEL:-120} python benchmarks/bench_model.py --out "$OUT/bench_model.json" \
    --profile "$OUT/profile_train_step.txt" ${MODEL_ARGS:-} 2>&1 | tee -a "$LOG"
  python benchmarks/kernel_roofline.py --profile "$OUT/profile_train_step.txt" \
    --record "$OUT/bench_model.json" --out "$OUT/kernels.json" 2>&1 | tee -a "$LOG"
fi
if stage model14; then  # the 1.4b training step (4 x 2048) beside mamba_ssm, with its profile
  echo "== bench_model 1.4b" | tee -a "$LOG"
  timeout ${T_MODEL14:-240} python benchmarks/bench_model.py --preset 1.4b --batch 4 \
    --iters ${MODEL14_ITERS:-5} --out "$OUT/bench_model_1.4b.json" \
    --profile "$OUT/profile_train_step_1.4b.txt" 2>&1 | grep -v "^ \|^-\|^Name\|^Self" | tee -a "$LOG"
  python benchmarks/kernel_roofline.py --profile "$OUT/profile_train_step_1.4b.txt" \
    --record "$OUT/bench_model_1.4b.json" --out "$OUT/kernels_1.4b.json" 2>&1 | tee -a "$LOG"
fi
if stage model3; then  # the 130m width and depth with Mamba-3 (8 x 2048) beside mamba_ssm's Mamba3, its autotune pruned (M3_PEER="" for the full one: minutes)
  echo "== bench_model 130m mamba3" | tee -a "$LOG"
  timeout ${T_MODEL3:-560} python benchmarks/bench_model.py --preset 130m --mixer mamba3 \
    --batch 8 --iters ${MODEL3_ITERS:-5} ${M3_PEER---prune-peer} --out "$OUT/bench_model_130m-mamba3.json" \
    --profile "$OUT/profile_train_step_130m-mamba3.txt" \
    2>&1 | grep -v "^ \|^-\|^Name\|^Self" | tee -a "$LOG"
fi
if stage m3layer; then  # the Mamba-3 layer beside upstream's at one width (M3_D, M3_SHAPE; upstream's autotune pruned), with both per-kernel profiles
  d=${M3_D:-2048}
  echo "== bench_mamba3 layer d_model $d" | tee -a "$LOG"
  timeout ${T_M3LAYER:-300} python benchmarks/bench_mamba3.py --only layer --d-model $d \
    --shape ${M3_SHAPE:-4x2048} --prune-peer --profile "$OUT/profile_m3_layer_d$d.txt" \
    --out "$OUT/bench_mamba3_layer_d$d.json" 2>&1 | grep -v "^ \|^-\|^Name\|^Self" | tee -a "$LOG"
fi
if stage model14m3; then  # the 1.4b width and depth with Mamba-3 (4 x 2048) beside mamba_ssm's Mamba3, its autotune pruned (M3_PEER="" for the full one)
  echo "== bench_model 1.4b mamba3" | tee -a "$LOG"
  timeout ${T_MODEL14M3:-560} python benchmarks/bench_model.py --preset 1.4b --mixer mamba3 \
    --batch 4 --iters ${MODEL14_ITERS:-5} ${M3_PEER---prune-peer} --out "$OUT/bench_model_1.4b-mamba3.json" \
    --profile "$OUT/profile_train_step_1.4b-mamba3.txt" \
    2>&1 | grep -v "^ \|^-\|^Name\|^Self" | tee -a "$LOG"
fi
if stage tests; then
  echo "== pytest -m gpu" | tee -a "$LOG"
  # the live-server tests import the openai client (a test extra the device lacks); they hold
  # no GPU test, so without the client they are left out rather than failing collection
  skip_server=""
  python -c "import openai" 2>/dev/null || skip_server="--ignore=tests/serve/test_server.py"
  timeout ${T_TESTS:-150} python -m pytest -m gpu -q --no-header -p no:cacheprovider $skip_server \
    ${TEST_PATHS:-tests} 2>&1 | tail -40 | tee -a "$LOG"
fi
if stage train; then
  echo "== gpu_train_check" | tee -a "$LOG"
  timeout ${T_TRAIN:-110} python scripts/gpu_train_check.py --steps ${TRAIN_STEPS:-200} --out "$OUT/train_check.json" 2>&1 | tee -a "$LOG"
fi
if stage decode; then
  echo "== bench_decode" | tee -a "$LOG"
  timeout ${T_DECODE:-300} python benchmarks/bench_decode.py --out "$OUT/bench_decode.json" ${DECODE_ARGS:-} 2>&1 | tee -a "$LOG"
fi
if stage dprofile; then  # per-kernel GPU time of a decode step and of an eager prefill
  echo "== decode_profile" | tee -a "$LOG"
  timeout ${T_DPROFILE:-120} python scripts/decode_profile.py --out "$OUT/decode_profile.txt" ${DPROFILE_ARGS:-} 2>&1 | tail -80 | tee -a "$LOG"
fi
if stage m3; then  # Mamba-3: the terms kernels' blocks, chunks and warps; the layer beside upstream's
  echo "== m3_terms_sweep" | tee -a "$LOG"
  for shape in ${M3_SHAPES-8x2048 1x4096}; do  # M3_SHAPES="": none
    timeout ${T_M3SWEEP:-90} python scripts/m3_terms_sweep.py --shape $shape 2>&1 | tee -a "$LOG"
  done
  if [ "${M3_CHUNK:-1}" = 1 ]; then
    echo "== m3_chunk_sweep" | tee -a "$LOG"
    timeout ${T_M3CHUNK:-250} python scripts/m3_chunk_sweep.py --shape 8x2048 --profile-out "$OUT/m3_profile.txt" 2>&1 | grep "^{" | tee -a "$LOG"
  fi
  echo "== bench_mamba3" | tee -a "$LOG"
  timeout ${T_M3:-150} python benchmarks/bench_mamba3.py --out "$OUT/bench_mamba3.json" ${M3_ARGS:---only layer --prune-peer} 2>&1 | tail -30 | tee -a "$LOG"
fi
if stage m3step; then  # the Mamba-3 decode step kernel alone: warps, batch, against a copy of its state
  echo "== m3_step_probe" | tee -a "$LOG"
  timeout ${T_M3STEP:-120} python scripts/m3_step_probe.py ${M3STEP_ARGS:---warps 0 1 2 4 8 16} 2>&1 | tee -a "$LOG"
fi
if stage m3fwd; then  # the Mamba-3 forward without autograd: chunks walked or in parallel, by shape
  echo "== m3_fwd_probe" | tee -a "$LOG"
  timeout ${T_M3FWD:-120} python scripts/m3_fwd_probe.py ${M3FWD_ARGS:-} 2>&1 | tee -a "$LOG"
fi
if stage m2fwd; then  # Mamba-2's forward without autograd: SSD kernels' variants, the Mamba-3 kernels, mamba_ssm
  echo "== m2_fwd_probe" | tee -a "$LOG"
  timeout ${T_M2FWD:-200} python scripts/m2_fwd_probe.py --out "$OUT/m2_fwd_probe.json" ${M2FWD_ARGS:-} 2>&1 | tee -a "$LOG"
fi
if stage m2; then  # Mamba-2: the layer, the 130m-mamba2 training step, prefill and decode beside mamba_ssm
  echo "== bench_mamba2" | tee -a "$LOG"
  timeout ${T_M2:-400} python benchmarks/bench_mamba2.py --out "$OUT/bench_mamba2.json" \
    --profile "$OUT/m2_profile.txt" ${M2_ARGS:-} 2>&1 | grep -v "^ \|^-\|^Name\|^Self" | tail -60 | tee -a "$LOG"
fi
if stage savetiles; then  # the scan's saved-state interval: kernels, then the training steps' time and peak
  echo "== save_tiles_probe" | tee -a "$LOG"
  timeout ${T_SAVETILES:-560} python scripts/save_tiles_probe.py --tiles ${SAVE_TILES:-1,4,8,16} \
    --models ${SAVE_TILES_MODELS:-130m:8,1.4b:4} --model-tiles ${SAVE_TILES_M:-1,8} --peer --out "$OUT/save_tiles_probe.json" \
    2>&1 | grep -v "^ \|^-" | tee -a "$LOG"
fi
if stage serve; then  # the serving engine: mixed and shared-prefix loads beside static generate
  # (1.4b, the whole benchmark: about 280 s on a warm H100, SERVE_PRESETS=1.4b T_SERVE=400;
  # the record is rewritten after every row, so a time limit keeps the rows so far; a load
  # that stalls prints the engine's stacks and ends the run: bench_serve --report-s)
  for preset in ${SERVE_PRESETS:-130m}; do
    echo "== bench_serve $preset" | tee -a "$LOG"
    timeout ${T_SERVE:-300} python benchmarks/bench_serve.py --preset $preset --device cuda \
      --out "$OUT/bench_serve_$preset.json" ${SERVE_ARGS:-} 2>&1 | tail -40 | tee -a "$LOG"
  done
fi
if stage servepack; then  # Mamba-1's packed prefill against the padded groups: the same loads in one call
  # (SERVEPACK_VARIANTS: one bench_serve argument set a line, 150-250 s each at 130m on the H100:
  # the whole benchmark with --timeline about 250)
  SERVEPACK_VARIANTS=${SERVEPACK_VARIANTS:-"--packed off
--packed on"}
  while IFS= read -r v; do
    tag=$(echo "$v" | tr -d ' -' | cut -c1-40)
    echo "== bench_serve 130m: $v" | tee -a "$LOG"
    timeout ${T_SERVEPACK:-280} python benchmarks/bench_serve.py --preset 130m --device cuda $v \
      --out "$OUT/bench_serve_$tag.json" 2>&1 | grep -v "^ \|^-\|USDT" | tail -14 | tee -a "$LOG"
  done <<< "$SERVEPACK_VARIANTS"
fi
if stage serveprof; then  # where the engine's time goes at 256 clients; the prefill budget swept
  SERVE_PREFILL=${SERVE_PREFILL:-2048 8192 32768}
  for pt in $SERVE_PREFILL; do
    echo "== bench_serve 130m, 256 clients, prefill_tokens $pt" | tee -a "$LOG"
    prof=""; [ "$pt" = "${SERVE_PREFILL%% *}" ] && prof="--profile $OUT/serve_profile.txt"
    timeout ${T_SERVEPROF:-200} python benchmarks/bench_serve.py --preset ${SERVEPROF_PRESET:-130m} \
      --device cuda --clients 256 --no-prefix --prefill-tokens $pt $prof ${SERVEPROF_ARGS:-} \
      --out "$OUT/bench_serve_prefill$pt.json" 2>&1 | grep -v "^ \|^-\|USDT" | tail -12 | tee -a "$LOG"
  done
fi
if stage servetl; then  # the mixed load at 256 clients with the engine's timeline, per engine setting
  # (SERVETL_VARIANTS: one bench_serve argument set a line, about 65 s each on the H100; the
  # first, the baseline without the hold, also runs the static batches (about 150 s in all)
  # unless SERVETL_STATIC=0)
  first=1
  while IFS= read -r v; do
    [ -z "$v" ] && continue
    tag=$(echo "$v" | sed 's/--//g; s/ /_/g' | tr -cd 'a-z0-9_-' | cut -c1-48); [ -z "$tag" ] && tag=default
    static="--no-static"; [ $first = 1 ] && [ "${SERVETL_STATIC:-1}" = 1 ] && static=""; first=0
    echo "== bench_serve 130m, 256 clients, timeline: ${v:-default}" | tee -a "$LOG"
    timeout ${T_SERVETL:-200} python benchmarks/bench_serve.py --preset ${SERVEPROF_PRESET:-130m} \
      --device cuda --clients 256 --no-prefix --timeline $static ${v#default} \
      --out "$OUT/bench_serve_tl_$tag.json" 2>&1 | grep -v "^ \|^-\|USDT" | tail -8 | tee -a "$LOG"
  done <<< "${SERVETL_VARIANTS:---prefill-hold none
default
--prefill-tokens 32768 --prefill-rows 32}"
fi
if stage servehold; then  # the mixed load at 256 clients with the prefill held for larger launches
  for hold in ${SERVE_HOLDS:-"8192,30" "16384,60"}; do
    echo "== bench_serve 130m, 256 clients, prefill_hold $hold" | tee -a "$LOG"
    timeout ${T_SERVEHOLD:-150} python benchmarks/bench_serve.py --preset ${SERVEPROF_PRESET:-130m} \
      --device cuda --clients 256 --no-prefix --prefill-hold $hold ${SERVEHOLD_ARGS:-} \
      --out "$OUT/bench_serve_hold${hold%%,*}.json" 2>&1 | grep -v "^ \|^-\|USDT" | tail -8 | tee -a "$LOG"
  done
fi
if stage serveflight; then  # prefill launches in flight: 1 (the default) against 2, same loads
  for k in ${SERVE_FLIGHTS:-1 2}; do
    echo "== bench_serve 130m, prefills_in_flight $k" | tee -a "$LOG"
    timeout ${T_SERVEFLIGHT:-200} python benchmarks/bench_serve.py --preset ${SERVEPROF_PRESET:-130m} \
      --device cuda --prefills-in-flight $k ${SERVEFLIGHT_ARGS:-} \
      --out "$OUT/bench_serve_flight$k.json" 2>&1 | grep -v "^ \|^-\|USDT" | tail -12 | tee -a "$LOG"
  done
fi
if stage serveprobe; then  # prefill forwards by (rows, piece length) and the decode step by batch
  echo "== serve_probe" | tee -a "$LOG"
  timeout ${T_SERVEPROBE:-200} python scripts/serve_probe.py --presets ${SERVEPROBE_PRESETS:-130m} \
    --out "$OUT/serve_probe.json" 2>&1 | tee -a "$LOG"
fi
if stage packprobe; then  # packed prefill forwards against whole prompts in padded rows
  echo "== pack_probe" | tee -a "$LOG"
  timeout ${T_PACKPROBE:-200} python scripts/pack_probe.py --out "$OUT/pack_probe.json" 2>&1 | tee -a "$LOG"
fi
if stage rl; then  # small float-input backbones: the step and the T=32 training window
  echo "== bench_rl" | tee -a "$LOG"
  timeout ${T_RL:-240} python benchmarks/bench_rl.py --device both --out "$OUT/bench_rl.json" \
    ${RL_ARGS:-} 2>&1 | tail -60 | tee -a "$LOG"
fi
if stage rlprof; then  # per-kernel GPU time of the RL step, graph-replayed and eager
  echo "== rl_step_profile" | tee -a "$LOG"
  timeout ${T_RLPROF:-120} python scripts/rl_step_profile.py ${RLPROF_ARGS:-} 2>&1 | tail -${RLPROF_LINES:-120} | tee -a "$LOG"
fi
if stage gemmprobe; then  # small-batch f32 GEMMs: cuBLAS's picks against other routes
  echo "== small_gemm_probe" | tee -a "$LOG"
  timeout ${T_GEMM:-120} python scripts/small_gemm_probe.py ${GEMM_ARGS:-} 2>&1 | tail -60 | tee -a "$LOG"
fi
if stage stepsweep; then  # the Mamba-1 decode step's launch settings (STEP_ARGS), then whole model steps of each mixer (STEP_MODELS)
  echo "== step_sweep" | tee -a "$LOG"
  timeout ${T_STEP:-240} python scripts/step_sweep.py ${STEP_ARGS:---presets 130m 1.4b --batch 1 2 3 4 --tiles 16384 --rows-max 1 2 4} \
    2>&1 | grep -v Warn | tee -a "$LOG"
  if [ -n "${STEP_MODELS-130m 130m-mamba2 130m-mamba3 1.4b}" ]; then
    timeout ${T_STEPM:-240} python scripts/step_sweep.py --models ${STEP_MODELS-130m 130m-mamba2 130m-mamba3 1.4b} \
      --batch ${STEP_MODEL_BATCH:-2 3 4} --rows-max ${STEP_MODEL_ROWS:-1 2 4} 2>&1 | grep -v Warn | tee -a "$LOG"
  fi
fi
if stage prefillhost; then  # an eager prefill's host time, ours and mamba_ssm's: enqueue, graph, CPU profile
  echo "== prefill_host" | tee -a "$LOG"
  timeout ${T_PHOST:-240} python scripts/prefill_host.py ${PHOST_ARGS:-} --out "$OUT/prefill_host.txt" 2>&1 | tail -${PHOST_LINES:-200} | tee -a "$LOG"
fi
if stage optim; then  # the clip + AdamW step: foreach, fused, fused with the clip folded in (the Trainer's)
  echo "== optimizer_timing" | tee -a "$LOG"
  timeout ${T_OPTIM:-120} python scripts/optimizer_timing.py --device cuda --models ${OPTIM_MODELS:-130m 1.4b} \
    --out "$OUT/optimizer_timing.json" 2>&1 | tee -a "$LOG"
fi
echo "== done" | tee -a "$LOG"
