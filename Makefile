# The two entry points of the README. Both set up .venv first (scripts/setup.sh, idempotent).
.PHONY: setup train test bench
export HF_HUB_OFFLINE := 1

setup:
	@bash scripts/setup.sh

train: setup  # quiet: the progress bar and a summary; the full log goes to the run folder (MOLT_QUIET=0: all of it)
	MOLT_QUIET=$${MOLT_QUIET:-1} .venv/bin/molt fit --config recipes/default.yaml

test: setup
	.venv/bin/python -m pytest -q -ra --durations=15

bench: setup
	.venv/bin/python benchmarks/loop_overlap.py
