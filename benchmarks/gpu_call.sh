#!/usr/bin/env bash
# One device call for the GPU stage's figures: the CUDA tests, the last stage's loss, an inner step's
# host reads (inner_step.py), a hop's copy
# to the device from pageable and pinned memory (hop_host.py), the stage against the plain HF loop
# at a preset (eager, REPEATS times, each run with its own plain loop), the overlap schedule's
# held-out loss against exact over PRICE_STEPS steps, what two processes sharing the GPU cost it
# (gpu_shared.py), the profile with each result waited for and as it runs now, int8 hops encoded on
# the device, the decoder layers compiled (pipeline.compile), a residual subspace of SUBSPACE, then
# stage 0's memory peak against the estimate.
# Every step has its own timeout inside a total BUDGET (s); a step that no longer fits is skipped
# and says so (at medium on an H200 one call holds about the tests, three eager repeats and the
# price: REPEATS=1 reaches the later steps). Results print as they come and land as JSON under $OUT.
#
# What the call carries (the device machine reaches no package index): .gpu/whl, the wheels of the
# packages its python lacks, and .gpu/cache, this machine's ~/.cache/noloco-node (the corpus and the
# trained tokenizer, so no process trains it again); `bash scripts/gpu_bundle.sh` builds both.
#   device:          bash benchmarks/gpu_call.sh           (the run tool: carry [".gpu"])
#   CPU dry run:     DEVICE=cpu PRESET=tiny PY=.venv/bin/python OUT=/tmp/gpuout bash benchmarks/gpu_call.sh
set -u
T0=$(date +%s)
BUDGET=${BUDGET:-560}
DEVICE=${DEVICE:-cuda}
PRESET=${PRESET:-medium}
REPEATS=${REPEATS:-3}
PRICE_STEPS=${PRICE_STEPS:-50}
PY=${PY:-python3}
O=${OUT:-/tmp/gpuout}; mkdir -p "$O"
exec > >(tee "$O/run.log") 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
left() { echo $((BUDGET - ($(date +%s) - T0))); }
if [ "$PRESET" = tiny ]; then SIZE="--seq-len 64 --batch 8 --micro 2"; else SIZE="--seq-len 1024 --batch 16 --micro 4"; fi
if [ "$DEVICE" = cuda ]; then SCALE=1; else SCALE=${CPU_SCALE:-2}; fi  # a CPU dry run is slower per step

step() {  # step LABEL SECONDS CMD...: run CMD with at most SECONDS (and what the budget has left)
  local label=$1 secs=$(($2 * SCALE)); shift 2
  local l; l=$(left)
  if ((secs > l - 10)); then secs=$((l - 10)); fi
  if ((secs < 25)); then echo "== $label: SKIPPED (${l}s of the budget left)"; return; fi
  echo "== $label: up to ${secs}s, t=$(($(date +%s) - T0))s"
  local s0; s0=$(date +%s)
  PYTHONPATH="$SITE$PWD:$PWD/benchmarks" timeout -k 5 "$secs" "$@" 2>&1 | grep -v -E "Warning|warnings.warn|USDT|^\s*$"
  echo "== $label: rc=${PIPESTATUS[0]} in $(($(date +%s) - s0))s"
}

SITE=""
if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl 2>&1 \
    | grep -v "root" | tail -3
  SITE=/tmp/site:
  mkdir -p "$HOME/.cache/noloco-node" && cp -r .gpu/cache/* "$HOME/.cache/noloco-node/"
  PYTHONPATH=/tmp/site "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', \
transformers.__version__, torch.cuda.get_device_name())"
fi
echo "setup done at t=$(($(date +%s) - T0))s"

TESTS=${TESTS:-tests/unit/model/test_stage_cuda.py tests/integration/test_compile.py tests/unit/pipeline tests/unit/optim \
tests/unit/codec tests/unit/wire/test_codec_enum.py tests/unit/node/test_swarm_in_process.py}
step "CUDA unit tests" 90 "$PY" -m pytest -q -p no:cacheprovider -n "${XDIST:-6}" --timeout 80 $TESTS
if [ "$PRESET" = tiny ]; then HEAD="--tokens 256 --hidden 64 --vocab 4096"; else HEAD="--tokens 4096 --hidden 2048 --vocab 128256"; fi
step "last stage's loss: whole logits vs chunked" 40 "$PY" benchmarks/head_loss.py --device "$DEVICE" $HEAD \
  --json "$O/head_loss.json"
step "an inner step's host reads and launches, against a bare Adam step" 30 "$PY" benchmarks/inner_step.py \
  --device "$DEVICE" --preset "$PRESET" --json "$O/inner_step.json"
step "a hop's host work, and its copy to the device from pageable and pinned memory" 40 "$PY" benchmarks/hop_host.py \
  --preset "$PRESET" --codecs bf16,int8 --repeats 5 --threads 4 --json "$O/hop_host.json"
STAGE="$PY benchmarks/gpu_stage.py --device $DEVICE --preset $PRESET $SIZE --steps 5 --warmup 2 --swarm-timeout 110"
EAGER="--runs hf,exact,overlap,processes"
PROFILE="$PY benchmarks/gpu_profile.py --device $DEVICE --preset $PRESET $SIZE --warmup 2 --steps 4 --profile-steps 2"
# The figures first (eager repeats, the overlap's price, the profile before and after the
# results left to the waiter), then what may move them. Repeat 1 also runs exact with each result
# waited for on the compute thread (pipeline.overlap_result_copies = false): the same-run baseline.
step "stage vs plain loop, eager, repeat 1" 160 $STAGE --runs hf,exact,exact-waiting,overlap,processes \
  --json "$O/stage_eager_1.json"
step "overlap's loss price, $PRICE_STEPS steps" 150 $STAGE --price-only --price-steps "$PRICE_STEPS" --seeds 0 \
  --json "$O/price.json"
step "profile, results waited for" 60 $PROFILE --wait-results --label waiting --json "$O/profile_waiting.json"
step "profile" 60 $PROFILE --label now --json "$O/profile.json"
step "two processes sharing the GPU (the ceiling of processes P=2)" 90 "$PY" benchmarks/gpu_shared.py \
  --device "$DEVICE" --preset "$PRESET" $SIZE --seconds 15 --json "$O/gpu_shared.json"
for r in $(seq 2 "$REPEATS"); do
  step "stage vs plain loop, eager, repeat $r" 130 $STAGE $EAGER --json "$O/stage_eager_$r.json"
done
step "int8 hops, encoded on the device" 100 $STAGE --runs hf,exact,processes --codec int8 --json "$O/stage_int8.json"
step "stage vs plain loop, compiled layers" 200 $STAGE --runs hf,exact,processes --compile --warmup 3 \
  --json "$O/stage_compiled.json"
step "residual subspace k = d/16, exact and overlap" 100 $STAGE --runs hf,exact,overlap --subspace "${SUBSPACE:-128}" \
  --json "$O/stage_subspace.json"
if [ "$PRESET" = tiny ]; then MEM="--seq-len 64 --micro 2 --batch 8"; else MEM="--seq-len 1024 --micro 4 --batch 16"; fi
for c in 3:0:exact 3:0:overlap; do  # stage 0 holds a batch of graphs: the shared weight casts' memory
  step "memory peak vs estimate, $PRESET:$c" 45 "$PY" benchmarks/memory_estimate.py --device "$DEVICE" $MEM \
    --case "$PRESET:$c" --json
done
"$PY" benchmarks/gpu_summary.py "$O"
echo "== done at t=$(($(date +%s) - T0))s"
ls -la "$O"
