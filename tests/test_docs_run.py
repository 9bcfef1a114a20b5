"""The docs run: every shell block and Python block of README.md and docs/*.md is executed here, or listed with why not.

Each block is keyed by its page and its first command (``README.md: molt fit --config recipes/default.yaml ...``).
``RUNS`` says how the suite runs a block: its commands exactly as the page writes them, in a scratch folder that
links the repository's top-level entries, with ``.venv/bin`` first on PATH (what ``. .venv/bin/activate`` does), and
each command shortened by the arguments written beside it (``+ --trainer.max_steps 2``: appended; a later flag wins),
or with a placeholder filled in (``NAME`` -> ``default``). ``LISTED`` names the blocks and commands the suite does not
run, with why; ``make docs-long`` runs the listed ones this machine can run, as written (``MOLT_DOCS_LONG=1``).
A block on no list fails ``test_every_block_is_run_or_listed`` with the lines to add.

Not here: inline commands in prose (``tests/test_docs.py`` checks that each names a real subcommand, recipe and
reproduction) and the blocks that are no code to run (YAML recipe excerpts, trees, outputs: a block's language says).
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pandas as pd
import pytest
import yaml

from tests.test_docs import DOCS, read

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # .venv/bin: molt, molt-bench
RUN_LANGS = {"bash", "sh", "shell", "console", "python"}

# block key -> the commands of the block in order: (the command as the page writes it, what the suite does instead).
# "+ ARGS" appends ARGS; "A -> B" replaces A by B in the command; "serve" starts it (molt serve, molt view), asks it
# once and stops it; "" runs it as written.
RUNS: dict[str, list[tuple[str, str]]] = {
    "README.md: source .venv/bin/activate": [
        ("source .venv/bin/activate", ""),
        ("molt fit --config recipes/default.yaml --trainer.max_steps 30", "+ --trainer.max_steps 2"),
        ("molt view runs/default/version_0", "serve"),
    ],
    "README.md: molt sft --config recipes/sft_tiny.yaml": [  # after the block above, in the same folder
        ("molt sft --config recipes/sft_tiny.yaml", "+ --trainer.max_steps 2"),
        ("molt export runs/default/version_0/checkpoints/last.ckpt out/", ""),
        ("molt serve --policy out/", "serve"),
        ("molt eval --config recipes/default.yaml --model.policy out/", ""),
    ],
    "docs/workflow.md: molt sft --config recipes/sft_tiny.yaml": [
        ("molt sft --config recipes/sft_tiny.yaml", "+ --trainer.max_steps 2"),
        ("molt fit --config recipes/default.yaml --model.policy runs/sft_tiny/policy",
         "+ --trainer.max_steps 1 --model.engine molt_lightning.engines.TorchEngine"),
    ],
    "docs/workflow.md: make extra-smollm2 extra-data": [  # data/train.jsonl and data/test.jsonl: made by the test
        ("molt fit --config recipes/dataset.yaml",
         "+ --trainer.max_steps 2 --model.agent.init_args.max_tokens 24 --model.rollout.group_size 2 "
         "--model.rollout.prompts_per_step 2"),
    ],
    "docs/reproducing.md: molt-bench reproduce --list": [
        ("molt-bench reproduce --list", ""),
    ],
    "docs/molt-bench.md: molt-bench run arithmetic-tiny --stack molt --seeds 3 --out runs/molt-async": [
        ("molt-bench compare-published \"molt=119.4,2.3,3\" \"baseline=109.5,10.3,3\" --goal min --margin 10%", ""),
    ],
    "docs/configuration.md: from molt_lightning import AsyncRLModule, Batching, Optim, Rollout": [("python", "exec")],
    "docs/agents.md: import json, openai": [("python", "exec")],
    "docs/configuration.md: AsyncRLModule(": [("python", "signature")],
    "docs/research.md: def top_entropy(inp: SelectionInputs, cfg) -> torch.Tensor:": [
        ("python", "source molt_lightning/algorithms/selection.py")],
    "docs/research.md: def overlong_filter(inp: SelectionInputs, cfg) -> torch.Tensor:": [
        ("python", "source molt_lightning/algorithms/selection.py")],
    "docs/tinker.md: molt tinker --policy molt_lightning.models.tiny.arithmetic_policy": [
        ("molt tinker --policy molt_lightning.models.tiny.arithmetic_policy", "serve")],
}

# what the suite does not run, and why. "long": `make docs-long` runs it as written; "no": it cannot run here.
LISTED: dict[str, tuple[str, str]] = {  # (and, for "long", the start of commands make docs-long skips: DOCS_LONG_SKIPS)
    "README.md: make train": ("long", "the README's two commands: `make test` is CI's own command, `make train` the "
                                      "default run (100 steps, ~2-6 min)"),
    "README.md: molt fit --config recipes/default.yaml --trainer.strategy ddp --trainer.devices 2": (
        "long", "two ranks, 100 steps; tests/test_distributed.py runs the recipe under ddp and fsdp2"),
    "README.md: make extra-smollm2 && molt fit --config recipes/smollm2_addition.yaml": (
        "long", "SmolLM2-135M, 40 steps (~10 min); tests/test_smollm2.py runs it"),
    "docs/scale.md: molt fit --config recipes/default.yaml --trainer.strategy ddp --trainer.devices 2": (
        "long", "two ranks, 100 steps each; tests/test_distributed.py runs the recipe under ddp and fsdp2"),
    "docs/workflow.md: make extra-smollm2 extra-data": (
        "run", "make test installs every extra (pyproject's test extra names them all: tests/test_extras.py); run "
               "in a scratch folder it would point .venv's editable install there"),
    "docs/workflow.md: molt export runs/dataset/version_0/checkpoints/last.ckpt out/": (
        "no", "exports the run on your own data/train.jsonl; the README's block exports and serves the default run"),
    "docs/workflow.md: molt serve --policy out/": ("no", "serves the export above"),
    "docs/workflow.md: make extra-smollm2 && molt sft --config recipes/sft_smollm2.yaml": (
        "long", "SmolLM2-135M fine-tuned (needs make extra-smollm2); tests/test_sft.py runs 2 steps of it"),
    "docs/workflow.md: make extra-smollm2 extra-data (2)": (
        "no", "reads the export and a checkpoint of a 23-minute chain_sum run (molt-bench reproduce smollm2-chain-sum "
              "makes one; runs/.../last.ckpt is a placeholder for it); tests/test_evaluation.py runs molt eval"),
    "docs/workflow.md: molt export runs/default/version_0/checkpoints/last.ckpt out/": (
        "no", "reads the checkpoints of a default run and a LoRA run of the user's (make train; molt fit --config "
              "recipes/lora.yaml); tests/test_export.py exports both, merged and not"),
    "docs/algorithms.md: for s in 0 1 2; do for r in grpo grpo_kl dr_grpo dapo gspo cispo rloo reinforce reinforce_pp "
    "ppo icepop; do": ("no", "33 runs of 60 steps (about an hour here): molt-bench reproduce algorithms; "
                             "tests/test_algorithms_loop.py trains each overlay's algorithm stacked on the default"),
    "docs/molt-bench.md: molt-bench run arithmetic-tiny --stack molt --seeds 3 --out runs/molt-async": (
        "long", "six runs of the protocol, then the import of TensorBoard files of a slime run (tb/seed0: a "
                "placeholder for yours); tests/bench/ runs each command on small run sets"),
    "docs/reproducing.md: molt-bench reproduce default-run": ("long", "the default run and its report (~6 min)"),
    "docs/tinker.md: molt-bench reproduce tinker-side-by-side": (
        "long", "15 runs of 40 steps, twice (~6 min); tests/bench/test_bench_tinker_cookbook.py runs the stack end to "
                "end and tests/bench/ each command on small run sets"),
    "docs/research.md: molt fit --config recipes/default.yaml --config recipes/research/forking_tokens.yaml": (
        "run", "tests/test_research.py runs each research overlay 2 steps through molt fit"),
    "docs/research.md: make setup-test && .venv/bin/python -m pytest -q tests/test_selection.py": (
        "run", "CI's make test runs the suite, tests/test_selection.py and the fast tier included"),
    "docs/view.md: molt view runs/default/version_0": (
        "run", "the README's block serves a run with molt view; tests/test_view_browser.py drives the pages"),
    "docs/view.md: molt view runs/default/version_0 runs/default/version_1 runs/molt-async runs/molt-sync": (
        "run", "runs and run sets of the user's; tests/test_view_browser.py serves a run and two run sets"),
    "docs/scale.md: MOLT_API_KEY=T PORT=8000 scripts/multinode.sh server": (
        "no", "several hosts; tests/test_multinode.py runs two nodes on loopback"),
    "docs/testing.md: python -m pytest benchmarks/micro/test_micro.py": (
        "long", "the micro-benchmarks (minutes); tests/test_micro_benchmarks.py checks their table"),
    "README.md: \"\"\"Quickstart: 30 RL steps teach the built-in tiny policy to use a calculator tool, mean reward "
    "~0.2 -> ~0.8 (vLLM on":
        ("run", "tests/test_scripts.py::test_readme_quickstart_runs_as_a_script runs it"),
    "docs/agents.md: # the stock OpenAI client                         (molt_lightning.tasks.python_tool.openai_agent)":
        ("no", "excerpts of the agents it names (tasks.python_tool, tasks.framework_agents), which "
               "tests/test_frameworks.py trains"),
    "docs/agents.md: async def agent(client, sample) -> float:  # molt_lightning.tasks.python_tool.anthropic_agent, "
    "in full": ("no", "tasks.python_tool.anthropic_agent with its tool lines cut: tests/test_frameworks.py trains it"),
    "docs/agents.md: # OpenAI Agents SDK: the stock client of this trajectory as the model, tracing off (it traces to "
    "OpenAI otherwise)": ("no", "excerpts of tasks.framework_agents, which tests/test_frameworks.py trains"),
    "docs/agents.md: molt tasks check molt_lightning/tasks/terminal": (
        "run", "tests/test_tasks_check.py::test_the_shipped_tasks_check_clean_as_the_docs_show runs the check and "
               "holds the table shown to what it prints"),
    "docs/agents.md: molt tasks check my-tasks": (
        "no", "a task set of the user's; tests/test_tasks_check.py::"
              "test_a_broken_set_is_listed_whole_each_problem_with_its_fix_and_fails checks a broken one"),
    "docs/tinker.md: make extra-tinker": (
        "run", "make test installs every extra (pyproject's test extra names them all: tests/test_extras.py)"),
    "docs/tinker.md: import tinker": (
        "run", "needs the server the block above starts: tests/test_tinker.py::test_the_docs_sdk_block_runs runs it "
               "as written against one, its two lines exported"),
    "docs/tinker.md: import asyncio": (
        "no", "a conversations file and the folder the server printed, the user's; "
              "tests/test_tinker_cookbook.py runs this Config on files it writes"),
}


def commands(text: str) -> list[str]:
    """A shell block's commands: continuation lines joined, comments and blank lines dropped."""
    out, pending = [], ""
    for line in text.splitlines():
        if pending == "" and line.lstrip().startswith("#"):
            continue
        line = re.sub(r"\s+#\s.*$", "", line) if "#" in line else line
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip() + " "
            continue
        if pending.strip():
            out.append(" ".join(pending.split()))
        pending = ""
    return out


def blocks():
    """(key, language, text) of every fenced block of the docs in a language that runs."""
    return [b for b in blocks_of_any_language() if b[1] in RUN_LANGS]


def blocks_of_any_language():
    """(key, language, text) of every fenced block of the docs; a block of no language that runs is keyed by its
    page and language (the first of them)."""
    for path in DOCS:
        doc, seen = read(path), {}
        raw = doc.text.splitlines()
        for first, text in doc.blocks:
            lang = re.match(r"\s*(?:```+|~~~+)\s*(\w*)", raw[first - 2])[1]
            head = next((line.strip() for line in text.splitlines() if line.strip()), "")
            cmds = commands(text) if lang in RUN_LANGS - {"python"} else []
            key = f"{doc.name}: {lang if lang not in RUN_LANGS else cmds[0] if cmds else head}"
            seen[key] = seen.get(key, 0) + 1
            yield key + (f" ({seen[key]})" if seen[key] > 1 else ""), lang, text  # the second block so keyed: (2)


def uncovered() -> tuple[list[str], list[str]]:
    """(commands and blocks on no list, entries of the lists that name nothing of the docs)."""
    missing, names = [], set()
    for key, lang, text in blocks():
        page = key.split(": ")[0]
        names.add(key)
        if lang == "python":
            missing += [] if key in RUNS or key in LISTED else [key]
            continue
        run_here = [cmd for cmd, _ in RUNS.get(key, [])]
        for cmd in commands(text):
            names.add(f"{page}: {cmd}")
            if cmd not in run_here and key not in LISTED and f"{page}: {cmd}" not in LISTED:
                missing.append(f"{page}: {cmd}" + ("" if f"{page}: {cmd}" == key else f"  (in the block {key})"))
    return missing, sorted((set(RUNS) | set(LISTED)) - names)


def test_every_block_is_run_or_listed():
    missing, stale = uncovered()
    assert not missing, "commands of the docs that the suite neither runs nor lists (add each to RUNS or LISTED in " \
        "tests/test_docs_run.py):\n" + "\n".join(missing)
    assert not stale, "entries of tests/test_docs_run.py that name no block or command of the docs (gone or " \
        "changed):\n" + "\n".join(stale)
    for key, (kind, _) in LISTED.items():
        assert kind in ("long", "no", "run"), key


def test_the_runs_name_the_blocks_commands_as_written():
    """A block in RUNS is run command by command as the page writes it: an edit of the page shows here."""
    text = {key: t for key, lang, t in blocks() if lang != "python"}
    for key, steps in RUNS.items():
        if steps[0][0] == "python":
            continue
        written = commands(text[key])
        for cmd, _ in steps:
            assert cmd in written, f"{key}: the page no longer has `{cmd}` (it has: {written})"


def test_the_listed_tests_exist():
    for key, (_, why) in LISTED.items():
        for path, name in re.findall(r"(tests/[\w/]+\.py)(?:::(\w+))?", why):
            assert (ROOT / path).exists(), f"{key}: {path} does not exist"
            assert not name or f"def {name}(" in (ROOT / path).read_text(), f"{key}: {path} has no {name}"


def test_the_readme_activates_the_venv_before_its_first_command(tmp_path):
    """`make train` puts molt in .venv/bin, which a new shell does not have on PATH: the README's first command block
    activates it first, and only then is `molt` found."""
    first = next(t for k, lang, t in blocks() if k.startswith("README.md: ") and "molt " in t)
    assert commands(first)[0] == ACTIVATE
    cwd = scratch(tmp_path)
    bare = subprocess.run(["bash", "-c", "command -v molt"], cwd=cwd, env=shell_env(), capture_output=True, text=True)
    assert bare.returncode != 0, bare.stdout  # a new shell: no molt
    assert run("command -v molt", cwd).strip().endswith(".venv/bin/molt")


def test_what_the_readme_commands_write_is_ignored_by_git():
    """The README's runs write runs/ and out/ in the checkout: git status stays clean (before: out/ was not ignored)."""
    written = {"runs/default/version_0/metrics.csv", "out/model.safetensors"}
    done = subprocess.run(["git", "check-ignore", "--no-index", *written], cwd=ROOT, capture_output=True, text=True)
    assert set(done.stdout.split()) == written, done.stdout


def test_the_command_splitter():
    assert commands("a b  # c\n# d\n\ne \\\n  f\n") == ["a b", "e f"]


# ----- running them -----

def scratch(tmp_path: Path) -> Path:
    """A folder with the repository's top-level entries linked: commands write runs/ and out/ here."""
    for entry in ROOT.iterdir():
        if entry.name not in {".git", "runs", "out"} and (entry.name == ".venv" or not entry.name.startswith(".")):
            (tmp_path / entry.name).symlink_to(entry)
    return tmp_path


def shell_env() -> dict:
    """A new shell's environment: .venv/bin is not on PATH until the README's `source .venv/bin/activate` runs."""
    logs = ROOT.parent / "shared" / "real-logs"  # scripts/real_logs_examples.sh's default, from the scratch folder
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if Path(p).resolve() != BIN.resolve())
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    return {**env, "PATH": path, "HF_HUB_OFFLINE": "1", "MOLT_QUIET": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
            "MOLT_REAL_LOGS": os.environ.get("MOLT_REAL_LOGS", str(logs))}


ACTIVATE = "source .venv/bin/activate"  # the README's once-per-shell line; every command runs after it


def suite_command(cmd: str, how: str) -> str:
    if how.startswith("+ "):
        return f"{cmd} {how[2:]}"
    if " -> " in how:
        old, new = how.split(" -> ")
        assert old in cmd, (cmd, how)
        return cmd.replace(old, new)
    return cmd


def run(cmd: str, cwd: Path, timeout: float = 900) -> str:
    done = subprocess.run(["bash", "-c", f"{ACTIVATE} && {cmd}"], cwd=cwd, env=shell_env(), capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"`{cmd}` failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout + done.stderr


def serve_and_ask(cmd: str, cwd: Path) -> None:
    """Start ``molt serve`` (``molt view``, ``molt tinker``) on a free loopback port, wait until it lists its model
    (its runs; says it is healthy), ask it once, stop it."""
    path, answer = {"molt view": ("/", "<h1>Runs</h1>"), "molt tinker": ("/api/v1/healthz", '"ok"')}.get(
        " ".join(cmd.split()[:2]), ("/v1/models", '"data"'))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(["bash", "-c", f"{ACTIVATE} && exec {cmd} --port {port}"], cwd=cwd, env=shell_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline, models = time.monotonic() + 300, None
        while models is None:
            assert server.poll() is None, f"`{cmd}` exited: {server.stdout.read()[-3000:]}"
            assert time.monotonic() < deadline, f"`{cmd}` did not answer {path} within 300 s"
            try:
                models = urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5).read().decode()
            except OSError:
                time.sleep(0.5)  # polling the server's readiness (the event), not waiting for a duration
        assert answer in models, models
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)


def run_block(key: str, cwd: Path) -> None:
    for cmd, how in RUNS[key]:
        if how == "serve":
            serve_and_ask(cmd, cwd)
        else:
            run(suite_command(cmd, how), cwd)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_readme_commands_run(tmp_path):
    """The README's command blocks in order: the default recipe (2 steps), a warm start, export, serve, eval."""
    cwd = scratch(tmp_path)
    run_block("README.md: source .venv/bin/activate", cwd)
    run_block("README.md: molt sft --config recipes/sft_tiny.yaml", cwd)
    assert (cwd / "out" / "model.safetensors").exists()


def test_the_dataset_recipe_is_shown_as_it_ships():
    block = next(t for k, lang, t in blocks_of_any_language() if k == "docs/workflow.md: yaml")
    assert block + "\n" == (ROOT / "recipes" / "dataset.yaml").read_text(), \
        "docs/workflow.md's recipe block and recipes/dataset.yaml must be the same text: copy one to the other"


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_dataset_recipe_runs_on_smollm2_as_it_names(tmp_path):
    """recipes/dataset.yaml (SmolLM2, math-verify) on a small dataset of the test's: a metrics row per step, the
    held-out rounds, reward.png, as docs/workflow.md says."""
    cwd = scratch(tmp_path)
    (cwd / "data").mkdir()
    for name, pairs in [("train.jsonl", [(2, 3), (10, 7), (4, 4), (9, 1)]), ("test.jsonl", [(6, 2), (5, 5)])]:
        rows = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in pairs]
        (cwd / "data" / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_block("docs/workflow.md: make extra-smollm2 extra-data", cwd)
    folder = cwd / "runs" / "dataset" / "version_0"
    metrics = pd.read_csv(folder / "metrics.csv")
    assert metrics["reward"].notna().sum() == 2, metrics  # a row per step (log_every_n_steps: 1)
    assert any(c.startswith("eval/") and c.endswith("avg@4") for c in metrics.columns)
    assert (folder / "reward.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("key", ["docs/workflow.md: molt sft --config recipes/sft_tiny.yaml",
                                 "docs/reproducing.md: molt-bench reproduce --list",
                                 "docs/molt-bench.md: molt-bench run arithmetic-tiny --stack molt --seeds 3 --out "
                                 "runs/molt-async",
                                 "docs/tinker.md: molt tinker --policy molt_lightning.models.tiny.arithmetic_policy"])
def test_docs_commands_run(key, tmp_path):
    run_block(key, scratch(tmp_path))


def python_block(key: str) -> str:
    return next(text for k, lang, text in blocks() if k == key and lang == "python")


def test_python_blocks_run():
    """The complete Python blocks run: their imports resolve and what they build is built."""
    from molt_lightning.tasks.arithmetic import calculator_agent, tasks

    for key, steps in RUNS.items():
        if steps[0] != ("python", "exec"):
            continue
        scope = {"agent": calculator_agent, "tasks": tasks}  # what a fragment takes from the page around it
        exec(compile(python_block(key), key, "exec"), scope)  # noqa: S102 - the docs' own code


def test_python_blocks_that_show_the_packages_code_are_its_code():
    """A block that shows a function of the package (docs/research.md's selections) is that function, verbatim."""
    for key, steps in RUNS.items():
        if steps[0][0] == "python" and steps[0][1].startswith("source "):
            source = (ROOT / steps[0][1].removeprefix("source ")).read_text()
            assert python_block(key).strip() in source, f"{key}: not the code of {steps[0][1]}: copy it again"


def test_configuration_lists_the_module_signature():
    """docs/configuration.md's ``AsyncRLModule(...)`` block names every parameter, in order, with its default."""
    from molt_lightning import AsyncRLModule

    call = ast.parse(python_block("docs/configuration.md: AsyncRLModule(")).body[0].value
    written = [ast.unparse(a) for a in call.args] + [f"{k.arg}={ast.unparse(k.value)}" for k in call.keywords]
    params = inspect.signature(AsyncRLModule).parameters.values()
    actual = [p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}" for p in params]
    assert [w.split("=")[0] for w in written] == [a.split("=")[0] for a in actual]
    for w, a in zip(written, actual):
        if "=" in w and not w.endswith("()"):  # literal defaults (records are shown as their constructor)
            assert ast.literal_eval(w.split("=", 1)[1]) == ast.literal_eval(a.split("=", 1)[1]), (w, a)


# ----- make docs-long -----

DOCS_LONG_SKIPS = ("molt-bench import tb/", "molt-bench check runs/slime",  # a slime run's files: yours, not ours
                   "make test",  # the whole suite: CI's own command, not a doc block's
                   "python -m pytest benchmarks/micro/test_micro.py --benchmark-storage=file://benchmarks/micro/baseline"
                   " --benchmark-save")  # it would add a baseline file to the repository

@pytest.mark.skipif(os.environ.get("MOLT_DOCS_LONG") != "1", reason="make docs-long runs these (MOLT_DOCS_LONG=1)")
@pytest.mark.parametrize("key", sorted(k for k, (kind, _) in LISTED.items() if kind == "long"))
def test_listed_blocks_run_as_written(key):
    """In the repository itself (a `make extra-NAME` in a scratch folder would point .venv's install there): runs/
    and out/ are written here, as for a user."""
    cwd, texts = ROOT, {k: t for k, lang, t in blocks() if lang != "python"}
    done = [cmd for cmd, _ in RUNS.get(key, [])]  # the suite runs these already
    for cmd in commands(texts[key]) if key in texts else [key.split(": ", 1)[1]]:
        if cmd.startswith("molt serve"):
            serve_and_ask(cmd, cwd)
        elif cmd not in done and not cmd.startswith(DOCS_LONG_SKIPS):
            run(cmd, cwd, timeout=7200)


# ----- extras named beside the commands that need them -----

def recipe_extras(name: str) -> set[str]:
    """The extras ``recipes/NAME`` needs: what ``molt`` refuses it without (a SmolLM2 policy: smollm2)."""
    from molt_lightning.extras import needed

    path = ROOT / "recipes" / name
    if not path.exists():
        return set()
    text = path.read_text()
    return set(needed(yaml.safe_load(text))) | ({"smollm2"} if "molt_lightning.models.smollm2" in text else set())


def paragraphs(path: Path):
    """(line, text) of each paragraph of a page: a fenced block is one, with the paragraph before it."""
    lines, start, chunk, fenced = path.read_text().splitlines(), 0, [], False
    for i, line in enumerate(lines + [""]):
        if line.strip().startswith(("```", "~~~")):
            fenced = not fenced
        if not line.strip() and not fenced and chunk and not chunk[-1].rstrip().endswith(":"):
            yield start + 1, "\n".join(chunk)
            chunk = []
        elif line.strip() or fenced:
            start = i if not chunk else start
            chunk.append(line)


def test_every_command_names_the_extras_it_needs():
    """A ``molt`` command on a recipe that needs an extra has ``make extra-NAME`` in the same paragraph or block (or
    names it as ``extra-NAME``: ``make extra-smollm2 extra-data``)."""
    problems = []
    for path in DOCS:
        for line, text in paragraphs(path):
            for m in re.finditer(r"\bmolt (?:fit|eval|sft)\b[^`\n]*?--config\s+recipes/([\w/]+\.yaml)", text):
                for extra in sorted(recipe_extras(m[1]) - set(re.findall(r"\bextra-(\w+)", text))):
                    problems.append(f"{path.relative_to(ROOT)}:{line}: recipes/{m[1]} needs make extra-{extra}")
    assert not problems, "commands whose extra is not named beside them:\n" + "\n".join(sorted(set(problems)))
