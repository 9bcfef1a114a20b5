# The two entry points of the README, and the edit loop's tier. Each sets up .venv first (scripts/setup.sh,
# idempotent): `make train` only what the default run needs, `make test` and `make test-fast` the test tools too.
.PHONY: setup setup-test train test test-fast bench
export HF_HUB_OFFLINE := 1

setup:
	@bash scripts/setup.sh train

setup-test:
	@bash scripts/setup.sh test

train: setup  # quiet: the progress bar and a summary; the full log goes to the run folder (MOLT_QUIET=0: all of it)
	MOLT_QUIET=$${MOLT_QUIET:-1} .venv/bin/molt fit --config recipes/default.yaml

# Everything, on two workers (pytest-xdist): one runs the tests of the shared vLLM engines and SmolLM2 in file order
# (tests/conftest.py), both share the rest. PYTEST_ARGS=... adds or overrides (e.g. PYTEST_ARGS="-n 0": serial).
test: setup-test
	.venv/bin/python -m pytest -q -ra --durations=25 -n 2 --dist loadgroup $(PYTEST_ARGS)

# The edit loop's tier: the unit and pure tests, no real engine, no training run (the `slow` marker), one worker.
test-fast: setup-test
	.venv/bin/python -m pytest -q -ra -m "not slow" -p no:cacheprovider $(PYTEST_ARGS)

bench: setup-test
	.venv/bin/python benchmarks/loop_overlap.py
