# The two entry points of the README, and the edit loop's tier. Each sets up .venv first (scripts/setup.sh,
# idempotent): `make train` only what the default run needs, `make test` and `make test-fast` the test tools too.
.PHONY: setup setup-test train test test-fast bench docs-long
export HF_HUB_OFFLINE := 1

setup:
	@bash scripts/setup.sh train

setup-test:
	@bash scripts/setup.sh test

# `make extra-NAME`: the default set-up and one optional extra of pyproject.toml, pinned (data, smollm2, lora,
# agents, trl, bench, envs, tinker); the command a missing extra's error names (molt_lightning/extras.py)
extra-%: setup
	@bash scripts/setup.sh extra $*

train: setup  # quiet: the progress bar and a summary; the full log goes to the run folder (MOLT_QUIET=0: all of it)
	MOLT_QUIET=$${MOLT_QUIET:-1} .venv/bin/molt fit --config recipes/default.yaml

# Everything, on two workers (pytest-xdist): one runs the tests of the vLLM engines and SmolLM2 in file order, both
# share the rest, longest first (tests/helpers/suite.py); then the `serial` tests in one process. PYTEST_ARGS=... adds
# or overrides ("-n 0": one process).
test: setup-test
	.venv/bin/python -m pytest -q -ra --durations=25 -n 2 -m "not serial" $(PYTEST_ARGS)
	.venv/bin/python -m pytest -q -ra -m serial $(PYTEST_ARGS) || [ $$? -eq 5 ]  # 5: PYTEST_ARGS left none of them

# The edit loop's tier: the unit and pure tests, no real engine start, nothing over 1.5 s (the `slow` marker).
test-fast: setup-test
	.venv/bin/python -m pytest -q -ra -m "not slow" -n 2 $(PYTEST_ARGS)

# The docs' commands that the suite lists instead of running (tests/test_docs_run.py's LISTED, "long"), as written:
# the long runs (SmolLM2, two ranks for 100 steps, the default run's reproduction, ...): an hour or more on 2 cores.
docs-long: setup-test
	MOLT_DOCS_LONG=1 .venv/bin/python -m pytest -q -ra tests/test_docs_run.py -k listed_blocks_run_as_written $(PYTEST_ARGS)

bench: setup-test
	.venv/bin/python benchmarks/loop_overlap.py
