#!/usr/bin/env bash
# One device call (issue 32, item 3): benchmarks/time_to_loss.py on the GPU, the wide shape first
# (hidden 1024, 8 layers), then `tiny` with what is left. Each has an internal deadline that keeps
# the curves its runs reached; results land as JSON under $OUT.
#   device: bash .gpu/ttl/run.sh
#   CPU dry run here: DEVICE=cpu PY=.venv/bin/python OUT=/tmp/ttlout BUDGET=150 SMALL=1 bash .gpu/ttl/run.sh
set -u
T0=$(date +%s)
BUDGET=${BUDGET:-315}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
G=$PWD/.gpu
O=${OUT:-/tmp/ttlout}; mkdir -p "$O"
exec > >(tee "$O/run.log") 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
left() { echo $((BUDGET - ($(date +%s) - T0))); }
W=${W:-2}
if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
  MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  if [ "$MEM" -gt 100000 ]; then W=24; else W=14; fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$G"/whl/*.whl 2>&1 | grep -v root | tail -3
  export PYTHONPATH=/tmp/site:$PWD
  mkdir -p /root/.cache/noloco-node && cp -r "$G"/cache/* /root/.cache/noloco-node/
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
fi
echo "setup done at t=$(($(date +%s) - T0))s, $W workers"
B="$PY benchmarks/time_to_loss.py --device $DEVICE --workers $W --threads 1 --seeds 0,1,2 --extend 1.5 --lr 1e-3 --warmup-steps 30"
if [ "${SMALL:-0}" = 1 ]; then  # the dry run: the same logic at a toy size
  WIDE="--hidden 256 --layers 2 --heads 4 --intermediate 512 --seq-len 32 --batch 4 --micro 2 --steps 6 --eval-every 3 --eval-batches 2 --time-steps 2 --time-warmup 1 --warmup-steps 2 --configs dense:bf16,dense:int4,sub8:int4,sub64:int4"
  TINY="--preset tiny --seq-len 32 --batch 4 --micro 2 --steps 6 --eval-every 3 --eval-batches 2 --time-steps 2 --time-warmup 1 --warmup-steps 2 --configs dense:bf16,sub16:int4"
else
  WIDE="--hidden 1024 --layers 8 --heads 16 --intermediate 2816 --seq-len 256 --batch 8 --micro 4 --steps ${WSTEPS:-200} --eval-every 20 --eval-batches 8 --time-steps 10 --time-warmup 3"
  TINY="--preset tiny --seq-len 128 --batch 8 --micro 2 --steps 300 --eval-every 25 --eval-batches 16 --time-steps 10 --time-warmup 3"
fi
D=$(( $(left) - ${TINY_S:-75} ))
echo "== wide: deadline ${D}s, t=$(($(date +%s) - T0))s"
timeout -k 5 $((D + 40)) $B $WIDE --deadline-s "$D" --json "$O/wide_gpu.json" 2>&1 | grep -v -E "Warning|warnings.warn|^\s*$"
echo "== wide done at t=$(($(date +%s) - T0))s"
D=$(( $(left) - 15 ))
if [ "$D" -gt 30 ]; then
  echo "== tiny: deadline ${D}s"
  timeout -k 5 $((D + 40)) $B $TINY --deadline-s "$D" --json "$O/tiny_gpu.json" 2>&1 | grep -v -E "Warning|warnings.warn|^\s*$"
fi
# the .parts folders stay: each run's curve so far, if the call is cut before a deadline merges them
echo "== done at t=$(($(date +%s) - T0))s"
ls -la "$O"
