#!/usr/bin/env bash
# Create or refresh the virtualenv at .venv/ and install noloco-node with its test tools.
# Idempotent: a second run with an unchanged pyproject.toml only checks and returns.
# On a machine without a GPU, torch==2.13.0 must come from a CPU wheel: pip's configured
# find-links/index (as on the project machines) or PIP_EXTRA_INDEX_URL pointing at a CPU index.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-$(command -v python3.11 || command -v python3)}"
"$py" - <<'PY' || { echo "noloco-node needs Python >= 3.11 (set PYTHON=/path/to/python3.11)" >&2; exit 1; }
import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)
PY
[ -x .venv/bin/python ] || "$py" -m venv .venv
stamp=".venv/.noloco-setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || ! .venv/bin/python -c "import noloco_node, torch, hivemind, grpc" 2>/dev/null; then
  export PIP_DISABLE_PIP_VERSION_CHECK=1
  # torch first and alone, so nothing later can resolve it to another build.
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[dev,experiments]"
  rm -f .venv/.noloco-setup-*
  touch "$stamp"
fi
# The NAT test builds home routers in network namespaces with iptables (Debian's package). As root
# with apt, install it when missing; elsewhere that test says why it skips.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v iptables >/dev/null; then
  (apt-get install -y -qq iptables >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq iptables >/dev/null 2>&1; }) \
    || echo "note: could not install iptables; the NAT topology test will skip" >&2
fi
# The dashboard's browser test drives Debian's chromium (Playwright's own browsers are never
# downloaded); elsewhere that test says why it skips.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v chromium >/dev/null; then
  (apt-get install -y -qq chromium >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; }) \
    || echo "note: could not install chromium; the dashboard's browser test will skip" >&2
fi
if .venv/bin/python -m pip list 2>/dev/null | grep -qi '^nvidia-'; then
  command -v nvidia-smi >/dev/null || echo "warning: CUDA wheels are installed on a machine without nvidia-smi" >&2
fi
echo "set up: $root/.venv ($(.venv/bin/python -c "import noloco_node; print(\"noloco-node\", noloco_node.__version__)"))"
