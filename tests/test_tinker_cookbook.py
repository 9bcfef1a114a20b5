"""tinker-cookbook's own trainers, unchanged, against a ``molt tinker`` process on the embedded tiny policy.

- The supervised trainer (``supervised.train.main``) on a local conversations file: ``train_mean_nll`` falls; the
  run and the server are killed after a checkpoint, a new server starts on the same state folder, and the same command
  resumes from the cookbook's last checkpoint (``checkpoints.jsonl``: ``load_weights`` with the optimizer).
- The DPO trainer (``preference.train_dpo.main``), whose reference is a sampler saved before the first step: its loss
  starts at exactly ln 2 and falls (a reference served from the live weights, as one self-hosted server did, keeps it
  at ln 2: GMISWE/tinker-cloud #16).
- The RL trainer (``rl.train.main``) with an environment written against the cookbook's environment interface
  (``bench.stacks.tinker_env``: molt's arithmetic questions, reward 1 for the right tool call): the reward rises.

Each runs as a cookbook user runs it: ``base_url`` and the API key pointed at the server, ``model_name`` the model
folder, ``renderer_name="qwen3_instruct"`` (molt's tiny ChatML).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

pytest.importorskip("tinker", reason="the tinker extra (make extra-tinker)")
pytest.importorskip("tinker_cookbook", reason="tinker-cookbook (make extra-tinker installs it)")

from molt_lightning.models.tiny import arithmetic_policy  # noqa: E402
from molt_lightning.tasks.arithmetic import make_problem  # noqa: E402

KEY = "tml-cookbook-test"
pytestmark = pytest.mark.slow  # ~20-30 s each: a server process and a cookbook run


@contextmanager
def molt_tinker(state_dir):
    """``molt tinker --port 0`` as a process (the molt-bench stack's ``Server``); yields its base URL once it printed
    it."""
    from molt_lightning.bench.stacks.tinker_cookbook import Server, server_command

    state_dir.mkdir(parents=True, exist_ok=True)
    server = Server(server_command(arithmetic_policy(), KEY, state_dir), state_dir / "server.log",
                    {**os.environ, "HF_HUB_OFFLINE": "1"})
    url, _ = server.start(120)
    try:
        yield url
    finally:
        server.stop()


def rows(log_path) -> list[dict]:
    with open(os.path.join(log_path, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


SFT = """
import asyncio, sys
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
folder, conversations, log_path, url = sys.argv[1:5]
common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=folder, renderer_name="qwen3_instruct", max_length=64,
                                        batch_size=8)
asyncio.run(train.main(train.Config(
    log_path=log_path, model_name=folder, recipe_name="molt_sft", renderer_name="qwen3_instruct", base_url=url,
    learning_rate=2e-3, lora_rank=8, save_every=4, eval_every=0, max_steps=int(sys.argv[5]),
    dataset_builder=FromConversationFileBuilder(file_path=conversations, common_config=common))))
"""


def test_the_cookbooks_supervised_trainer_learns_and_resumes_after_a_crash(tmp_path):
    folder, rng = arithmetic_policy(), random.Random(0)
    conversations, log_path = tmp_path / "conversations.jsonl", tmp_path / "sft"
    with open(conversations, "w") as f:
        for _ in range(96):
            p = make_problem(rng)
            f.write(json.dumps({"messages": [{"role": "user", "content": p["question"]},
                                             {"role": "assistant", "content": f"CALC {p['expression']}"}]}) + "\n")
    (tmp_path / "sft.py").write_text(SFT)
    env = {**os.environ, "TINKER_API_KEY": KEY, "HF_HUB_OFFLINE": "1"}

    def sft(url: str, max_steps: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(tmp_path / "sft.py"), folder, str(conversations), str(log_path),
                                 url, str(max_steps)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    with molt_tinker(tmp_path / "state") as url:  # a run of 12 steps, killed with the server after its step-8 save
        run = sft(url, 12)
        deadline = time.monotonic() + 300
        while not (log_path / "checkpoints.jsonl").exists() or '"000008"' not in (
                log_path / "checkpoints.jsonl").read_text():
            assert run.poll() is None, run.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint at step 8"
            time.sleep(0.05)
        run.kill()
        run.wait()
    before = rows(log_path)
    nll = [r["train_mean_nll"] for r in before]
    assert nll[7] < 0.8 * nll[0], nll
    with molt_tinker(tmp_path / "state") as url:  # a new server process: it has only the state folder
        rerun = sft(url, 12)
        assert rerun.wait(300) == 0, rerun.stderr.read().decode()[-3000:]
    after = rows(log_path)
    # the same command went on from the step-8 checkpoint (the cookbook drops the rows after it), not from step 0
    # and not from a fresh adapter
    assert [r["step"] for r in after] == list(range(12))
    assert after[:8] == before[:8]
    assert after[8]["train_mean_nll"] < 0.8 * nll[0]


def test_the_cookbooks_rl_trainer_raises_the_reward(tmp_path, monkeypatch):
    from tinker_cookbook.rl import train

    from molt_lightning.bench.stacks.tinker_env import TaskStreamBuilder

    monkeypatch.setenv("TINKER_API_KEY", KEY)
    folder, steps = arithmetic_policy(), 16
    dataset = TaskStreamBuilder(tasks="molt_lightning.tasks.arithmetic.tasks",
                                reward="molt_lightning.tasks.arithmetic.tool_call_reward", seed=0, batch_size=8,
                                group_size=8, steps=steps, model_name=folder, renderer_name="qwen3_instruct")
    with molt_tinker(tmp_path / "state") as url:
        asyncio.run(train.main(train.Config(
            log_path=str(tmp_path / "rl"), model_name=folder, recipe_name="molt_rl", renderer_name="qwen3_instruct",
            base_url=url, learning_rate=1e-3, max_tokens=16, temperature=1.0, lora_rank=16, save_every=1000,
            eval_every=0, max_steps=steps, dataset_builder=dataset)))
    reward = [r["env/all/reward/total"] for r in rows(tmp_path / "rl") if "env/all/reward/total" in r]
    assert len(reward) == steps
    assert sum(reward[-4:]) / 4 > sum(reward[:4]) / 4 + 0.3, reward
    # every sampled token was sampled by the policy the step before it trained on (the cookbook's sync loop)
    with open(tmp_path / "state" / "samples.jsonl") as f:
        versions = {v for row in map(json.loads, f) for v in row["versions"]}
    assert versions == set(range(steps))


def test_the_cookbooks_dpo_trainer_learns_against_a_frozen_reference(tmp_path, monkeypatch):
    from tinker_cookbook.preference import train_dpo
    from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
    from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    monkeypatch.setenv("TINKER_API_KEY", KEY)
    folder, rng, pairs = arithmetic_policy(), random.Random(1), tmp_path / "pairs.jsonl"
    with open(pairs, "w") as f:  # the tool call preferred over a guessed answer
        for _ in range(128):
            p = make_problem(rng)
            turn = [{"role": "user", "content": p["question"]}]
            f.write(json.dumps({"label": "A", "comparison": {
                "prompt_conversation": turn,
                "completion_A": [{"role": "assistant", "content": f"CALC {p['expression']}"}],
                "completion_B": [{"role": "assistant", "content": f"ANSWER {rng.randint(10, 99999)}"}]}}) + "\n")
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=folder, renderer_name="qwen3_instruct",
                                            max_length=64, batch_size=8)
    with molt_tinker(tmp_path / "state") as url:
        train_dpo.main(train_dpo.Config(
            log_path=str(tmp_path / "dpo"), model_name=folder, recipe_name="molt_dpo", renderer_name="qwen3_instruct",
            base_url=url, learning_rate=5e-3, lora_rank=8, dpo_beta=0.1, save_every=1000, eval_every=0, max_steps=12,
            dataset_builder=DPODatasetBuilderFromComparisons(
                comparison_builder=ComparisonBuilderFromJsonl(train_path=str(pairs)), common_config=common)))
    loss = [r["dpo_loss"] for r in rows(tmp_path / "dpo") if "dpo_loss" in r]
    assert len(loss) == 12 and loss[0] == pytest.approx(math.log(2), abs=1e-4), loss
    assert max(loss[-3:]) < 0.3, loss
