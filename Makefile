# The two entry points of the README. Both set up .venv first (scripts/setup.sh, idempotent).
.PHONY: setup train test bench
export HF_HUB_OFFLINE := 1

setup:
	@bash scripts/setup.sh

train: setup
	.venv/bin/molt fit --config recipes/default.yaml

test: setup
	.venv/bin/python -m pytest -q -ra

bench: setup
	.venv/bin/python benchmarks/loop_overlap.py
