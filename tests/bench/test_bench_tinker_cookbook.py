"""The ``tinker-cookbook`` stack: molt's single-turn task as a cookbook environment scored exactly as molt scores it,
the cookbook's ``metrics.jsonl`` read the cookbook's way, the protocol checks, the server's ready lines, and (with
``molt tinker`` present) a short run end to end."""

from __future__ import annotations

import asyncio
import json
import pickle
import sys
from itertools import islice
from pathlib import Path

import pytest

import molt_lightning
from molt_lightning.bench import protocol as protocol_, runner
from molt_lightning.bench.protocol import load_protocol
from molt_lightning.bench.runs import load_runset
from molt_lightning.bench.stacks import get_stack
from molt_lightning.tasks import arithmetic

pytest.importorskip("tinker_cookbook")
from molt_lightning.bench.stacks import tinker_cookbook as stack  # noqa: E402
from molt_lightning.bench.stacks import tinker_env  # noqa: E402

pytestmark = pytest.mark.timeout(600)
SAMPLE = {"question": "What is 37*58?", "expression": "37*58", "answer": 2146}
REWARD = "molt_lightning.tasks.arithmetic.tool_call_reward"


@pytest.fixture(scope="module")
def renderer():
    from tinker_cookbook import renderers
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    from molt_lightning.models.tiny import arithmetic_policy

    return renderers.get_renderer(stack.RENDERER, get_tokenizer(arithmetic_policy()))


@pytest.mark.parametrize("reply, stopped, score", [
    ("CALC 37*58", True, 1.0), ("CALC 37 * 58", True, 1.0), ("CALC 37*58\n", True, 1.0),
    ("CALC 37*58", False, 1.0),  # cut at max_tokens: no end-of-turn token, the same text
    ("CALC 58*37", True, 0.0), ("CALC 37+58", True, 0.0), ("CALC 37*58 please", True, 0.0),
    (" CALC 37*58", True, 0.0), ("ANSWER 2146", True, 0.0), ("", True, 0.0),
])
def test_the_env_scores_a_reply_as_tool_call_score(renderer, reply, stopped, score):
    """The reward is molt's score of the reply and nothing else (no format term: a reply cut at max_tokens that is
    the right call scores 1, as in molt), decoded as molt's ChatTemplate.decode_reply decodes it."""
    from molt_lightning.agents.chat import ChatTemplate

    env = tinker_env.SampleEnv(renderer, SAMPLE, REWARD)
    action = renderer.tokenizer.encode(reply, add_special_tokens=False) + ([2] if stopped else [])
    result = asyncio.run(env.step(action))
    assert result.reward == score == arithmetic.tool_call_score(reply, SAMPLE)
    assert result.episode_done and result.metrics == {"score": score}
    assert env.reply_text(action) == ChatTemplate(renderer.tokenizer).decode_reply(action) == reply


def test_the_prompt_is_what_single_turn_agent_sends(renderer):
    """One user message, no few-shot prefix, rendered token for token as the policy's chat template (the stack
    checks the same per seed), stopping on the end-of-turn token."""
    env = tinker_env.SampleEnv(renderer, SAMPLE, REWARD)
    prompt, stop = asyncio.run(env.initial_observation())
    tok = renderer.tokenizer
    want = tok.apply_chat_template([{"role": "user", "content": SAMPLE["question"]}], add_generation_prompt=True,
                                   tokenize=True, return_dict=True)["input_ids"]
    assert prompt.to_ints() == list(want) and stop == [tok.eos_token_id]
    stack.check_renderer(renderer, tok, SAMPLE["question"])

    class Other:  # a renderer that adds a system prompt is refused, naming both token lists
        def build_generation_prompt(self, messages):
            return renderer.build_generation_prompt([{"role": "system", "content": "Be brief."}, *messages])

    with pytest.raises(ValueError, match="does not render this policy's chat template"):
        stack.check_renderer(Other(), tok, SAMPLE["question"])


def test_the_dataset_is_the_seeds_task_stream_in_order_and_pickles():
    from molt_lightning.models.tiny import arithmetic_policy

    builder = tinker_env.TaskStreamBuilder(
        tasks="molt_lightning.tasks.arithmetic.tasks", reward=REWARD, seed=3, batch_size=2, group_size=4, steps=3,
        model_name=arithmetic_policy(), renderer_name=stack.RENDERER)
    dataset, test = asyncio.run(builder())
    assert test is None and len(dataset) == 3
    drawn = [g.sample for i in range(3) for g in dataset.get_batch(i)]
    assert drawn == list(islice(arithmetic.tasks(3), 6))  # what molt draws for seed 3, in order
    group = pickle.loads(pickle.dumps(dataset.get_batch(1)[0]))  # the cookbook may ship builders to workers
    envs = asyncio.run(group.make_envs())
    assert len(envs) == 4 and all(e.sample == drawn[2] for e in envs)


def test_a_cookbook_metrics_file_imports(tmp_path, capsys):
    """Rows as rl.train writes them: steps from 0, then a row of token totals at step = steps, which is no step."""
    from molt_lightning.bench.cli import main

    rows = [{"step": k, "progress/batch": k, "env/all/reward/total": r, "env/all/total_ac_tokens": 80 + k,
             "time/total": t, "time/sampling": t / 2, "optim/lr": 1e-3}
            for k, (r, t) in enumerate([(0.125, 2.0), (0.25, 1.0), (0.5, 1.5)])]
    rows.append({"step": 3, "tokens/cumulative/sampled": 243, "tokens/cumulative/trained": 600})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["import", str(tmp_path / "metrics.jsonl"), "--protocol", "arithmetic-single-turn-lora",
                 "--source-stack", "tinker-cookbook", "--out", str(tmp_path / "imp")]) == 0
    assert "reward <- env/all/reward/total, step_time_s <- time/total" in capsys.readouterr().out
    f = load_runset(tmp_path / "imp").frames[0]
    assert f["step"].tolist() == [1, 2, 3]  # 0-based -> 1-based; the totals row left out
    assert f["reward"].tolist() == [0.125, 0.25, 0.5]
    assert f["step_time_s"].tolist() == [2.0, 1.0, 1.5] and f["wall_s"].tolist() == [2.0, 3.0, 4.5]
    assert f["samples"].tolist() == [64, 128, 192]


def test_check_refuses_what_the_cookbook_cannot_run():
    s = get_stack("tinker-cookbook")
    run = lambda name, *sets: s.check(load_protocol(name, list(sets)).with_changes(s.changes))  # noqa: E731
    run("arithmetic-single-turn-lora")  # the matched protocol passes
    with pytest.raises(ValueError, match=r"task.max_turns=3: run the protocol's single-turn variant"):
        run("arithmetic-tiny")
    with pytest.raises(ValueError, match="trains a LoRA adapter .* this protocol has no model.lora"):
        run("arithmetic-single-turn")
    with pytest.raises(ValueError, match=r"cannot run model.lora.alpha=16"):
        run("arithmetic-single-turn-lora", "model.lora={r: 8, alpha: 16}")
    with pytest.raises(ValueError, match=r"cannot run algorithm.advantage='rloo'"):
        run("arithmetic-single-turn-lora", "algorithm.advantage=rloo")
    with pytest.raises(ValueError, match=r"cannot run algorithm=\['tis_cap'\]"):
        run("arithmetic-single-turn-lora", "algorithm.tis_cap=3.0")


def test_its_recorded_protocol_differs_from_molts_in_what_the_cookbook_fixes():
    """On the matched protocol, a tinker-cookbook run and a molt run differ in max_lag and the betas alone: those
    are the --allow-diff flags of the side-by-side (benchmarks/reported.yaml, tinker-side-by-side)."""
    p = load_protocol("arithmetic-single-turn-lora")
    cookbook = p.with_changes(get_stack("tinker-cookbook").changes)
    assert [d[0] for d in protocol_.diff(cookbook.data, p.data)] == ["max_lag", "optimizer.betas"]
    assert get_stack("molt").check(p) is None  # molt runs it as it is, LoRA included
    from molt_lightning.bench.stacks.molt import lora_spec

    assert (lora_spec(p).r, lora_spec(p).alpha) == (32, 32)


def _fake_server(tmp_path, lines: list[str], then: str):
    script = tmp_path / "fake_server.py"
    script.write_text("import sys, time\n" + "".join(f"print({line!r}, flush=True)\n" for line in lines) + then)
    return stack.Server([sys.executable, str(script)], tmp_path / "server.log", env=None)


def test_the_server_is_ready_on_its_export_lines_and_stops(tmp_path):
    server = _fake_server(tmp_path, ["loading", "export TINKER_BASE_URL=http://127.0.0.1:4321",
                                     "export TINKER_API_KEY=tml-abc"], "sys.stdin.read()\n")
    assert server.start(timeout_s=120) == ("http://127.0.0.1:4321", "tml-abc")
    server.stop()
    assert server.proc.returncode is not None
    assert "loading" in (tmp_path / "server.log").read_text()


def test_a_server_that_exits_before_ready_is_an_error_with_its_output(tmp_path):
    server = _fake_server(tmp_path, ["error: no such policy"], "sys.exit(2)\n")
    with pytest.raises(RuntimeError, match=r"exited with status 2 .*\n.*error: no such policy"):
        server.start(timeout_s=120)  # returns as soon as the output ends: no waiting out the deadline


def test_a_server_that_exits_during_training_ends_the_run_with_its_output(tmp_path):
    server = _fake_server(tmp_path, ["export TINKER_BASE_URL=http://127.0.0.1:4321", "export TINKER_API_KEY=tml-abc",
                                     "Traceback: the worker died"], "sys.exit(3)\n")
    server.start(timeout_s=120)
    with pytest.raises(RuntimeError, match=r"(?s)exited with status 3 during training.*\n.*the worker died"):
        asyncio.run(server.watch(asyncio.sleep(600)))  # not the SDK's minutes of retries against a dead address
    server.stop()


def test_the_adapter_the_server_trained_must_be_the_protocols(tmp_path):
    p = load_protocol("arithmetic-single-turn-lora")
    lora = p.data["model"]["lora"]
    saved = {"r": 32, "lora_alpha": 32.0, "target_modules": list(reversed(lora["target_modules"]))}
    for name in ("weights", "sampler_weights"):
        (tmp_path / "runs" / "m:train:0" / name / "final").mkdir(parents=True)
        (tmp_path / "runs" / "m:train:0" / name / "final" / "adapter_config.json").write_text(json.dumps(saved))
    stack.check_adapter(p, tmp_path)  # the same layers in another order
    with pytest.raises(ValueError, match=r"molt tinker trained rank 32, alpha 32 on .*lm_head.* and the protocol's "
                                         r"model.lora says rank 32, alpha 32 on \['down_proj'"):
        stack.check_adapter(p.with_changes({"model.lora.target_modules": ["down_proj", "up_proj"]}), tmp_path)
    with pytest.raises(RuntimeError, match="no adapter_config.json"):
        stack.check_adapter(p, tmp_path / "runs" / "nothing")


@pytest.mark.slow
@pytest.mark.skipif(not (Path(molt_lightning.__file__).parent / "tinker").is_dir(),
                    reason="molt tinker (molt_lightning/tinker/) is not in this checkout")
def test_the_cookbook_trains_through_molt_tinker(tmp_path):
    p = load_protocol("arithmetic-single-turn-lora", ["steps=2", "batch.prompts_per_step=2",
                                                      "batch.samples_per_prompt=4"])
    out = runner.run(p, "tinker-cookbook", 1, tmp_path / "tc", log=lambda *_: None)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["protocol"]["max_lag"] == 0 and manifest["protocol"]["optimizer"]["betas"] == [0.9, 0.95]
    f = load_runset(out).frames[0]
    assert f["step"].tolist() == [1, 2] and f["samples"].tolist() == [8, 16]
    assert f["reward"].between(0, 1).all() and (f["step_time_s"] > 0).all()
    assert (f["tokens_per_s_per_device"] > 0).all()
    assert (out / "seed_0" / "raw" / "cookbook" / "metrics.jsonl").exists()
    assert "TINKER_BASE_URL" in (out / "seed_0" / "raw" / "server.log").read_text()
