#!/usr/bin/env bash
# Build .gpu/, what benchmarks/gpu_call.sh carries to a device machine whose python (3.12, with a
# CUDA torch and the scientific stack) reaches no package index:
#   .gpu/whl    cp312 wheels of every package this project's .venv holds that the device's python
#               lacks or has older (the versions pinned here, so the device runs what the tests ran)
#   .gpu/cache  this machine's ~/.cache/noloco-node (the corpus and the trained tokenizer), so that
#               no process trains the tokenizer again there
# Idempotent; run it before the device call (`run` with carry [".gpu"]). Needs .venv (scripts/setup.sh).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
[ -x .venv/bin/python ] || bash scripts/setup.sh
out=.gpu/whl
mkdir -p "$out" .gpu/cache
# On the device already (torch and what it brings, the scientific stack), or not needed there
# (the linter, the browser driver, the plots, the proto generator, this project itself, the hub's
# command line and its download accelerator: nothing is downloaded there). The call's carry is
# capped at 64 MiB; this leaves about 55 MB.
skip='^(hf-xet|typer|click|rich|markdown-it-py|mdurl|shellingham|torch|triton|nvidia-.*|sympy|mpmath|networkx|jinja2|markupsafe|numpy|scipy|pandas|pyarrow|safetensors|tokenizers|uvloop|prometheus-client|msgpack|setuptools|pip|wheel|noloco-node|ruff|playwright|greenlet|pyee|grpcio-tools|matplotlib|contourpy|cycler|fonttools|kiwisolver|pillow|pyparsing|python-dateutil|six|tzdata|pytz)$'
pins=$(.venv/bin/python -m pip list --format=freeze --exclude-editable 2>/dev/null |
  awk -F'==' -v skip="$skip" '{n=tolower($1); gsub("_", "-", n); if (n !~ skip) print n "==" $2}')
platforms="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform any"
missing=()
for pin in $pins; do
  name=${pin%%==*}
  if ls "$out" | tr 'A-Z_' 'a-z-' | grep -q "^${name}-${pin##*==}-"; then continue; fi
  # shellcheck disable=SC2086
  if ! .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp $platforms -d "$out" "$pin" >/dev/null 2>&1; then
    missing+=("$pin")
  fi
done
# Pure-Python packages published only as sources: built into wheels here.
if ((${#missing[@]})); then
  .venv/bin/python -m pip wheel -q --no-deps -w "$out" "${missing[@]}"
fi
# The tokenizer of the embedded corpus, trained here if this machine has none under today's key.
.venv/bin/python -c "from noloco_node.config import load_config; from noloco_node.cli.demo import _prepare_tokenizer; \
_prepare_tokenizer(load_config())"
cp -r "$HOME/.cache/noloco-node/." .gpu/cache/ 2>/dev/null || echo "note: no ~/.cache/noloco-node yet (run the demo once)" >&2
echo ".gpu: $(ls "$out" | wc -l) wheels, $(du -sh .gpu | cut -f1)"
