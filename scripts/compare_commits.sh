#!/usr/bin/env bash
# Speed of this tree beside an older commit's, in one device call, mamba_ssm beside both:
#   mkdir bench_old && git archive OLD src | tar -x -C bench_old   (git ignores it: carry it)
#   run(command="bash scripts/compare_commits.sh", carry=[".peers", "bench_old"], timeout_s=600)
# For each stage the two trees take turns (new, old, new again with PASSES="new old new"):
# a slow spell of the shared host then falls on both. Records land under $OUT as
# <stage>-<pass>.json (benchmarks/common.py's format); the log is $OUT/compare.log.
#   STAGES: model (Trainer-default train step 130m 8x2048, prefill 1x4096),
#           decode (130m at batch 1 and 64), m3 (the Mamba-3 layer fwd+bwd), rl (the small
#           backbones' CUDA step, bench_rl.py --no-train; RL_ARGS adds), tests (GPU tests)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mambakit_out}
OLD=${OLD:-bench_old}
STAGES=${STAGES:-"model decode m3"}
PASSES=${PASSES:-"new old"}
mkdir -p "$OUT"
LOG="$OUT/compare.log"
PEERS=""
if ls .peers/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/peers .peers/*.whl \
    $(ls .whl/*.whl 2>/dev/null) 2>&1 | tail -2
  PEERS=/tmp/peers
fi
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader 2>&1 | tee "$LOG"
stage() { case " $STAGES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
tree() { [ "$1" = old ] && echo "$OLD/src" || echo src; }
first=1
bench() {  # bench <stage> <no-peer flag or ""> <program> <args...>: the peer on the first pass
  local name=$1 nopeer=$2 prog=$3; shift 3
  local i=0
  for p in $PASSES; do
    i=$((i + 1))
    local peer_flag=()
    [ "$i" -gt 1 ] && [ -n "$nopeer" ] && peer_flag=("$nopeer")
    echo "== $name $p" | tee -a "$LOG"
    PYTHONPATH="$(tree "$p")${PEERS:+:$PEERS}" timeout ${T_BENCH:-240} python "$prog" "$@" \
      "${peer_flag[@]}" --out "$OUT/$name-$p$i.json" 2>&1 | tail -${TAIL:-25} | tee -a "$LOG"
  done
}
if stage model; then
  bench model --no-peer benchmarks/bench_model.py --preset 130m --batch 8 --seqlen 2048
fi
if stage decode; then
  bench decode --no-peers benchmarks/bench_decode.py --presets 130m --batch 1 64 \
    --prefill-len ${PREFILL_LEN:-0}
fi
if stage m3; then
  bench m3 "" benchmarks/bench_mamba3.py --only layer --prune-peer
fi
if stage rl; then
  bench rl "" benchmarks/bench_rl.py --device cuda --no-train ${RL_ARGS:-}
fi
if stage tests; then
  echo "== pytest -m gpu" | tee -a "$LOG"
  PYTHONPATH="src${PEERS:+:$PEERS}" timeout ${T_TESTS:-300} python -m pytest -m gpu -q \
    --no-header -p no:cacheprovider ${TEST_PATHS:-tests} 2>&1 | tail -40 | tee -a "$LOG"
fi
echo "== done" | tee -a "$LOG"
