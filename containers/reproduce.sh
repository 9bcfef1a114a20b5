#!/usr/bin/env bash
# The CPU image's default command: reproduce reported results inside the container (or on a set-up machine) with
# `molt-bench reproduce`, each report written next to the reported numbers under reproductions/NAME/report.md.
#   RESULTS="default-run loop-overlap" (default) picks which; `molt-bench reproduce --list` shows them all.
# In the GPU image run the GPU recipe instead: RECIPE=recipes/default_gpu.yaml (a plain `molt fit`).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
if [ -n "${RECIPE:-}" ]; then exec .venv/bin/molt fit --config "$RECIPE"; fi
for name in ${RESULTS:-default-run loop-overlap}; do
  .venv/bin/molt-bench reproduce "$name"
done
