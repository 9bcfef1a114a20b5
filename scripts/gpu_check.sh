#!/usr/bin/env bash
# The GPU check, one command (under 10 minutes on one GPU): the embedded default recipe's loop on the CUDA device, with
# the torch engine and, where vLLM is installed, the in-process vLLM engine (vLLM's own weight loading: the path that
# no CPU run takes); prints s/step, peak GPU memory and whether every weight sync verified (sync/verified), as a table,
# and writes it as JSON to $OUT/gpu_check.json (or ./gpu_check.json).
#   bash scripts/gpu_check.sh               STEPS=30 BIG_STEPS=10 PYTHON=python3 by default
# Needs a CUDA torch with lightning, transformers and this project's requirements importable (`pip install -e .[gpu]`
# installs them with vLLM); nothing is downloaded: the tiny policy ships with the package.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
"$PY" -c "import torch; assert torch.cuda.is_available(), 'gpu_check: no CUDA device visible to torch'; \
print('gpu_check:', torch.cuda.get_device_name(), 'torch', torch.__version__)"
engines=torch
if "$PY" -c "import vllm" 2>/dev/null; then engines=torch,vllm; else echo "gpu_check: vllm is not installed: the vLLM row is skipped"; fi
out="${OUT:-.}/gpu_check.json"
timeout 570 "$PY" benchmarks/gpu_step.py --device cuda --engines "$engines" --steps "${STEPS:-30}" \
  --big-steps "${BIG_STEPS:-10}" --json "$out"
echo "gpu_check: wrote $out"
