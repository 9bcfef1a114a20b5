#!/usr/bin/env bash
# Reproduce the README's reported results inside a container (or on a set-up machine):
#  1. the default training run (reward per step as CSV + PNG under runs/default/),
#  2. the loop-overlap benchmark table (synchronous vs asynchronous, core split),
# and print where the artefacts are. RECIPE overrides the recipe (recipes/default_gpu.yaml in the GPU image).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
RECIPE=${RECIPE:-recipes/default.yaml}
.venv/bin/molt fit --config "$RECIPE"
run_dir=$(ls -dt runs/default/version_* | head -1)
.venv/bin/python - "$run_dir" <<'PY'
import sys, pandas as pd
df = pd.read_csv(f"{sys.argv[1]}/metrics.csv").groupby("step").first()
print(f"reward: first 5 steps {df['reward'].iloc[:5].mean():.3f}, last 10 steps {df['reward'].iloc[-10:].mean():.3f}")
print(f"artefacts: {sys.argv[1]}/metrics.csv, {sys.argv[1]}/reward.png")
PY
if [ "$RECIPE" = recipes/default.yaml ]; then .venv/bin/python benchmarks/loop_overlap.py --steps 30; fi
