"""Harnesses in their own process (``molt_lightning.agents.harness.Harness``): a script written against each stock
client gets its session from the environment and its reward is read back (reported, or graded by a verifier); a harness
that hangs (killed with its process group at the deadline), crashes, prints garbage or never calls the endpoint fails
its run with a counted reason; in training, those failures are counted and never trained on while the run goes on; the
endpoint leaves loopback only with a token."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from lightning.pytorch.loggers import CSVLogger

from molt_lightning import Rollout
from molt_lightning.agents.chat import ChatTemplate
from molt_lightning.agents.client import AgentClient
from molt_lightning.agents.wire.endpoint import Endpoint
from molt_lightning.engines import TorchEngine
from molt_lightning.agents.harness import Harness, HarnessFailed
from molt_lightning.tasks import python_tool
from molt_lightning.trajectory import Trajectory

from invariant import check_trained_tokens, fit_recorded  # noqa: E402
from scripted import ScriptedEngine, run_at_endpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "harness_agent.py")
BAD = str(ROOT / "tests" / "helpers" / "bad_harness.py")
SAMPLE = {"question": "What is 12*34?", "answer": 408, "n": 0}
CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(12*34)"}}</tool_call>'
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="the python tool's sandbox needs bubblewrap: apt-get install bubblewrap")


@pytest.fixture(scope="module")
def tool_tokenizer():
    from molt_lightning.models.tiny import train_tokenizer

    return train_tokenizer(400, 0, python_tool)


def run_harness(tokenizer, harness: Harness, replies, sample=SAMPLE):
    """Run ``harness`` once against an endpoint in front of a scripted engine: (result or exception, client,
    counts)."""
    counts = {}
    result, client = run_at_endpoint(ChatTemplate(tokenizer), itertools.chain(replies, itertools.repeat("0")),
                                     lambda client: harness(client, sample), catch=True,
                                     counter=lambda name, n=1: counts.__setitem__(name, counts.get(name, 0) + n))
    return result, client, counts


@needs_bwrap
@pytest.mark.slow
def test_an_openai_client_harness_reports_its_reward(tool_tokenizer):
    harness = Harness([sys.executable, EXAMPLE, "--wire", "openai", "--report", "reward"], timeout_s=120)
    result, client, counts = run_harness(tool_tokenizer, harness, [CALL, "408"])
    assert not isinstance(result, Exception), result
    assert result.reward == 1.0 and result.info["answered"] is True and result.info["harness_exit"] == 0
    assert [len(s) for s in client.trajectory.segments] == [4]  # prompt, call, tool output, answer: one segment
    assert counts == {}


@needs_bwrap
@pytest.mark.slow
def test_an_anthropic_client_harness_is_graded_by_a_verifier(tool_tokenizer):
    harness = Harness(f"{sys.executable} {EXAMPLE} --wire anthropic --report answer '{{question}}'", timeout_s=120,
                      score="exact")
    result, client, _ = run_harness(tool_tokenizer, harness, [CALL, "408"])
    assert not isinstance(result, Exception), result
    assert result.reward == 1.0 and result.info["answer"] == "408"
    wrong, _, _ = run_harness(tool_tokenizer, harness, ["407"])
    assert wrong.reward == 0.0 and wrong.info["answer"] == "407"


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] == "Z"  # a zombie is dead
    except (FileNotFoundError, IndexError):
        return True


@pytest.mark.slow
def test_a_hanging_harness_is_killed_with_its_process_group(tool_tokenizer, tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    result, client, counts = run_harness(tool_tokenizer, Harness([sys.executable, BAD, "hang", str(pid_file)],
                                                                 timeout_s=5), ["12"])
    assert isinstance(result, HarnessFailed) and "deadline of 5" in str(result)
    assert counts == {"harness/timeout": 1}
    grandchild = int(pid_file.read_text())  # written before the harness hung
    deadline = asyncio.run(_wait_until(lambda: _gone(grandchild), 30))
    assert deadline, f"the harness's own child {grandchild} outlived the kill of its process group"


async def _wait_until(condition, timeout_s: float) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not condition():
        if loop.time() > end:
            return False
        await asyncio.sleep(0.05)
    return True


@pytest.mark.parametrize("kind, counted, why", [
    ("crash", "harness/crashed", "exited with 3: about to fail"),
    ("garbage", "harness/no_reward", "reported no reward"),
    ("silent", "harness/no_requests", "never called the endpoint"),
])
def test_a_harness_that_crashes_prints_garbage_or_never_calls_fails_counted(tool_tokenizer, kind, counted, why):
    result, client, counts = run_harness(tool_tokenizer, Harness([sys.executable, BAD, kind], timeout_s=60), ["12"])
    assert isinstance(result, HarnessFailed) and why in str(result)
    assert counts == {counted: 1}
    assert client.trajectory.info["harness_exit"] == (3 if kind == "crash" else 0)


def test_the_harness_gets_its_session_and_the_sample_and_bad_templates_are_named(tool_tokenizer, tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import json, os\nkeys = ['OPENAI_BASE_URL', 'OPENAI_API_KEY', 'ANTHROPIC_BASE_URL', "
                     "'ANTHROPIC_API_KEY', 'MOLT_MODEL', 'MOLT_SAMPLE', 'EXTRA']\n"
                     "open(os.environ['MOLT_RESULT'], 'w').write(json.dumps({'reward': 0.25, 'info': "
                     "{k: os.environ.get(k) for k in keys}}))\nprint('not the reward')\n"
                     "import urllib.request as u\nu.urlopen(u.Request(os.environ['OPENAI_BASE_URL'] + "
                     "'/chat/completions', json.dumps({'model': 'policy', 'messages': [{'role': 'user', 'content': "
                     "'hi'}]}).encode(), {'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY'], "
                     "'Content-Type': 'application/json'})).read()\n")
    os.environ["OPENAI_API_KEY"] = "a-key-of-the-parent"  # never leaks into the harness's session
    try:
        result, client, _ = run_harness(tool_tokenizer, Harness([sys.executable, str(probe)], env={"EXTRA": "x"}),
                                        ["12"])
    finally:
        del os.environ["OPENAI_API_KEY"]
    assert not isinstance(result, Exception), result
    seen = result.info
    assert result.reward == 0.25 and seen["EXTRA"] == "x" and seen["MOLT_MODEL"] == "policy"
    assert seen["OPENAI_API_KEY"] == seen["ANTHROPIC_API_KEY"] == client.api_key
    assert seen["OPENAI_BASE_URL"] == client.base_url and seen["ANTHROPIC_BASE_URL"] == client.anthropic_base_url
    assert seen["OPENAI_BASE_URL"].startswith("http://127.0.0.1:")
    assert json.loads(seen["MOLT_SAMPLE"]) == SAMPLE
    assert Harness(["python", "x.py", "{question}"]).command(SAMPLE) == [sys.executable, "x.py", SAMPLE["question"]]
    with pytest.raises(ValueError, match="names 'answr'.*fields"):
        Harness(["echo", "{answr}"]).command(SAMPLE)
    with pytest.raises(ValueError, match="non-empty argv"):
        Harness([])


def test_the_endpoint_leaves_loopback_only_with_a_token():
    with pytest.raises(ValueError, match="endpoint_token"):
        Endpoint(["policy"], 1.0, host="0.0.0.0")  # refused before anything binds
    with pytest.raises(ValueError, match="endpoint_token"):
        Rollout(endpoint_host="10.1.2.3").check()
    endpoint = Endpoint(["policy"], 1.0, host="127.0.0.1", token="s3cret")
    client = AgentClient(ScriptedEngine([]), Trajectory(0, 0), None, 1.0, 16)
    client.attach(endpoint, "0-0")
    assert client.api_key.startswith("s3cret-") and endpoint.base_url.startswith("http://127.0.0.1:")
    endpoint.sock.close()


def numbered_tasks(seed: int = 0):
    """python_tool's tasks with a running number ``n`` (bad_harness.py's ``by-n`` picks its failure from it)."""
    for n, sample in enumerate(python_tool.tasks(seed)):
        yield {**sample, "n": n}


@pytest.mark.slow
def test_failing_harnesses_are_counted_and_never_trained_on_while_the_run_goes_on(tmp_path, monkeypatch):
    """Per prompt n: n % 8 = 0 hangs, 1 crashes, 2 prints garbage, 3 never calls the endpoint, the rest answer."""
    import psutil
    from transformers import AutoTokenizer

    harness = Harness([sys.executable, BAD, "by-n"], timeout_s=10)
    module, trainer, records, batches = fit_recorded(
        harness, numbered_tasks, monkeypatch, engine=TorchEngine(seed=0), steps=3, logger=CSVLogger(tmp_path),
        rollout=Rollout(group_size=2, prompts_per_step=2, max_lag=1, task_seed=1, max_failure_rate=1.0))
    assert trainer.global_step == 3
    counts = module.source.counts
    kinds = {k: v for k, v in counts.agent.items() if k.startswith("harness/")}
    assert counts.failed > 0 and counts.failed == sum(kinds.values()), (counts.failed, kinds)
    assert set(kinds) <= {"harness/timeout", "harness/crashed", "harness/no_reward", "harness/no_requests"}
    trained = [t for _, b in batches.seen for t in b.trajectories]
    assert trained and all(t.reward == 1.0 and t.info["harness_exit"] == 0 for t in trained)
    check_trained_tokens(records, batches, AutoTokenizer.from_pretrained(module.policy_path))
    def command(p: psutil.Process) -> str:  # "" for a process that has exited (a zombie runs nothing) or is gone
        try:
            return " ".join(p.cmdline())
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            return ""

    left = [p for p in psutil.Process().children(recursive=True) if BAD in command(p)]
    assert asyncio.run(_wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                                                   for p in left), 30)), left


@needs_bwrap
@pytest.mark.parametrize("wire", ["openai", "anthropic"])
@pytest.mark.slow
def test_a_harness_program_trains_with_the_invariant_checked(wire, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    harness = Harness([sys.executable, EXAMPLE, "--wire", wire], timeout_s=120)
    module, _, records, batches = fit_recorded(
        harness, python_tool.tasks, monkeypatch, engine=TorchEngine(seed=0), steps=2, logger=CSVLogger(tmp_path),
        rollout=Rollout(group_size=2, prompts_per_step=2, max_lag=1, task_seed=1))  # a harness process per run
    check_trained_tokens(records, batches, AutoTokenizer.from_pretrained(module.policy_path))
    trained = [t for _, b in batches.seen for t in b.trajectories]
    assert len(trained) == 2 * 2 * 2 and module.source.counts.failed == 0
    assert all("endpoint_errors" not in t.info and t.info["harness_exit"] == 0 for t in trained)


@pytest.mark.slow
def test_the_harness_recipe_runs_through_the_cli(tmp_path):
    import subprocess

    import pandas as pd

    out = subprocess.run(
        [sys.executable, "-m", "molt_lightning.commands.cli", "fit", "--config", "recipes/harness.yaml",
         "--model.engine", "molt_lightning.engines.TorchEngine", "--trainer.max_steps", "2",
         "--model.agent.init_args.command", '[python, tests/helpers/bad_harness.py, ok]',
         "--model.rollout.group_size", "2", "--model.rollout.prompts_per_step", "2",
         "--trainer.logger.init_args.save_dir", str(tmp_path)],
        cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    [run_dir] = list((tmp_path / "harness").iterdir())
    df = pd.read_csv(run_dir / "metrics.csv")
    assert sorted(df["step"].dropna().unique()) == [0, 1]
    assert df["samples/failed"].dropna().sum() == 0 and df["reward"].dropna().min() == 1.0
