"""Micro-benchmarks (pytest-benchmark) of the trainer's hot pieces, each also a test of its output.

- collation: ``trajectory.collate`` of one default step's 64 multi-turn calculator trajectories, and
  ``batching.plan`` + ``rows_of`` cutting that batch into micro-batches;
- chat delta: the tokens ``AgentClient.chat_turn`` appends for one more turn (``close_turn_ids`` + ``delta_ids``)
  against tokenizing the whole conversation again (``prompt_ids``), on the calculator task's second turn and on the
  25th turn of a long conversation;
- the loss: the default objective (PPO clip, token-level TIS in the decoupled form, token mean) forward + backward
  on fixed (64, 512) logprob tensors;
- the logprobs: ``Policy.forward`` (decoder, then the output head in chunks of 512 tokens under checkpointing) of the
  tiny default policy over the collated batch, forward + backward, against the full-logits route;
- weight files: ``VLLMEngine._write`` of the tiny policy's weight-sync buckets (safetensors in /dev/shm), then unlink.

Run, save and compare: see README.md, "Micro-benchmarks (pytest-benchmark)". Not collected by ``pytest`` alone
(``testpaths = ["tests"]``); ``tests/test_micro_benchmarks.py`` runs this file with ``--benchmark-disable``.
"""

from __future__ import annotations

import os

import pytest
import torch

from molt_lightning.algorithms import Algorithm, LossInputs, objective, off_policy
from molt_lightning.algorithms.losses import ppo_clip
from molt_lightning.trainer.plan import plan, rows_of
from molt_lightning.trainer.policy import Policy, logprobs_and_entropy
from molt_lightning.trajectory import Kind, collate

MICRO_BATCH_TOKENS = 1024


# ----- collation -----
@pytest.mark.benchmark(group="collation")
def test_collate(benchmark, trajectories, tokenizer):
    batch = benchmark(collate, trajectories, tokenizer.pad_token_id, max_version=3)
    rows = [[t for s in tr.segments[0] for t in s.token_ids] for tr in trajectories]
    assert batch.input_ids.shape == (64, max(map(len, rows)))
    for i, (tr, ids) in enumerate(zip(trajectories, rows)):
        assert batch.input_ids[i, :len(ids)].tolist() == ids
        assert not batch.attention_mask[i, len(ids):].any()
        policy = [s for s in tr.segments[0] if s.kind == Kind.POLICY]
        assert batch.engine_logprobs[i][batch.loss_mask[i]].tolist() == pytest.approx(
            [x for s in policy for x in s.logprobs])
    assert int(batch.loss_mask.sum()) == sum(t.num_policy_tokens for t in trajectories)


@pytest.mark.benchmark(group="collation")
def test_plan_micro_batches(benchmark, trajectories, tokenizer):
    batch = collate(trajectories, tokenizer.pad_token_id)

    def cut():
        minis = plan(batch, world=1, rank=0, mini_batches=2, micro_batch_tokens=MICRO_BATCH_TOKENS)
        return minis, [rows_of(batch, rows) for mb in minis for rows in mb.micro]

    minis, subs = benchmark(cut)
    rows = [r for mb in minis for micro in mb.micro for r in micro]
    assert sorted(rows) == list(range(64))
    assert all(s.input_ids.numel() <= MICRO_BATCH_TOKENS for s in subs)
    assert sum(int(s.loss_mask.sum()) for s in subs) == int(batch.loss_mask.sum())


# ----- chat delta -----
def _conversation(turns: int) -> list[dict]:
    """``turns`` calculator exchanges in one chat, ending on an assistant ``CALC`` reply (its tool turn is next)."""
    conv = []
    for i in range(turns):
        a, b = 100 + 7 * i, 10 + i
        conv += [{"role": "user", "content": f"What is {a}*{b}?"}, {"role": "assistant", "content": f"CALC {a}*{b}"},
                 {"role": "tool", "content": str(a * b)}, {"role": "assistant", "content": f"ANSWER {a * b}"}]
    return conv[:-2]


@pytest.mark.parametrize("route", ["delta", "full"])
@pytest.mark.parametrize("turns", [1, 12], ids=["calc-turn2", "long-turn24"])
def test_chat_next_turn(benchmark, template, route, turns):
    """The context of the next generation after a tool reply: the delta the client appends, or the whole chat."""
    benchmark.group = f"chat, turn {2 * turns}"
    conv = _conversation(turns)
    seen, new = conv, [{"role": "tool", "content": "1234"}]
    gen = template.encode(seen[-1]["content"]) + [template.eos_id]  # the engine's tokens of the last reply
    held = template.prompt_ids(seen[:-1]) + gen  # what the segment holds before the tool turn
    if route == "delta":
        out = benchmark(lambda: template.close_turn_ids(gen) + template.delta_ids(seen, new))
        assert held + out == template.prompt_ids(seen + new)  # token-exact against rendering it all at once
        assert len(out) < 16  # a few tokens, however long the chat
    else:
        out = benchmark(template.prompt_ids, seen + new)
        assert out == held + template.close_turn_ids(gen) + template.delta_ids(seen, new)


# ----- the loss -----
@pytest.fixture(scope="module")
def loss_inputs():
    """A (64, 512) batch: 8 groups x 8 rows, 128-token prompts, 64-384 policy tokens per row; the trainer's logprobs
    (with gradient), its detached pre-update ones (old) and the engine's a little off, advantages per row."""
    g = torch.Generator().manual_seed(0)
    n, t = 64, 512
    length = 128 + torch.randint(64, 385, (n,), generator=g)
    pos = torch.arange(t)[None]
    mask = (pos >= 128) & (pos < length[:, None])
    old = -3 * torch.rand(n, t, generator=g)
    engine = old + 0.05 * torch.randn(n, t, generator=g)
    logprobs = (old + 0.2 * torch.randn(n, t, generator=g)).clamp(max=0).requires_grad_()
    rewards = (torch.rand(n, generator=g) < 0.3).float().view(8, 8)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(n, 1)
    return logprobs, old, engine, (adv * mask).float(), mask


@pytest.mark.benchmark(group="loss")
def test_loss(benchmark, loss_inputs):
    logprobs, old, engine, adv, mask = loss_inputs
    cfg = Algorithm()

    def step():
        logprobs.grad = None
        corr = off_policy(old, engine, mask, cfg)
        inp = LossInputs(logprobs=logprobs, old_logprobs=corr.old_logprobs, advantages=adv, mask=mask,
                         is_weight=corr.weight)
        loss, metrics = objective(inp, ppo_clip, cfg)
        loss.backward()
        return loss, metrics

    loss, metrics = benchmark(step)
    # the reference, written out: -min(r A, clip(r) A) * min(pi_old / pi_engine, 2), mean over the policy tokens
    lp = logprobs.detach().double().requires_grad_()
    r = torch.exp(lp - old.double())
    per = -torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv) * torch.exp(old - engine).double().clamp(max=2.0)
    ref = torch.where(mask, per, 0.0).sum() / mask.sum()
    ref.backward()
    loss = loss.detach()
    assert torch.isfinite(loss)
    assert float(loss) == pytest.approx(float(ref.detach()), rel=1e-5, abs=1e-7)
    assert torch.allclose(logprobs.grad.double(), lp.grad, atol=1e-8)
    assert not logprobs.grad[~mask].any() and logprobs.grad[mask].any()
    assert 0 < float(metrics["loss/clip_frac"]) < 1


# ----- the logprobs: chunked head vs full logits -----
@pytest.mark.benchmark(group="logprobs")
@pytest.mark.parametrize("route", ["chunked", "full"])
def test_logprobs(benchmark, lm, trajectories, tokenizer, route):
    batch = collate(trajectories, tokenizer.pad_token_id)
    ids, attn, loss_mask = batch.input_ids, batch.attention_mask, batch.loss_mask
    policy = Policy(lm, chunk_tokens=512)
    sel = loss_mask[:, 1:]

    def step():
        lm.zero_grad(set_to_none=True)
        if route == "chunked":
            logprobs, entropy = policy(ids, attn, loss_mask, temperature=1.0)[:2]
        else:
            logits = lm(input_ids=ids, attention_mask=attn.long()).logits  # (N, T, V)
            logprobs, entropy = logprobs_and_entropy(logits, ids, 1.0, entropy_grad=False)
            logprobs, entropy = torch.where(sel, logprobs, 0.0), torch.where(sel, entropy, 0.0)
        logprobs.sum().backward()
        return logprobs.detach(), entropy.detach()

    logprobs, entropy = benchmark(step)
    assert logprobs.shape == sel.shape and sel.sum() > 512  # two chunks at least
    assert torch.isfinite(logprobs).all() and (logprobs[sel] < 0).all() and not logprobs[~sel].any()
    grad = lm.get_output_embeddings().weight.grad
    assert grad is not None and torch.isfinite(grad).all()
    with torch.no_grad():  # the other route, once: they must agree
        if route == "chunked":
            other = logprobs_and_entropy(lm(input_ids=ids, attention_mask=attn.long()).logits, ids, 1.0, False)
        else:
            other = policy(ids, attn, loss_mask, temperature=1.0)[:2]
    assert torch.allclose(logprobs[sel], other[0][sel], atol=1e-5)
    assert torch.allclose(entropy[sel], other[1][sel], atol=1e-5)


# ----- weight files -----
@pytest.mark.benchmark(group="weight-files")
def test_write_weight_files(benchmark, lm):
    """Staging a sync's buckets into their shared-memory slabs (``engines.shm``), as ``VLLMEngine.stage`` does: the
    slabs are written again in place every sync (before: a new safetensors file per bucket)."""
    from molt_lightning.engines.vllm import shm
    from molt_lightning.trainer.weights import buckets as sync_buckets

    staging = shm.Staging("/dev/shm" if os.path.isdir("/dev/shm") else None)
    buckets = list(sync_buckets(lm, 256 * 2**20))  # WeightSync's default bucket_mb
    try:
        slabs = benchmark(lambda: [staging.write(b) for b in buckets])
        nbytes = sum(t.numel() * t.element_size() for b in buckets for t in b.values())
        assert nbytes <= sum(os.path.getsize(s.path) for s in slabs) < nbytes + 64 * sum(map(len, buckets))
        back = shm.read(slabs)
        assert all(torch.equal(back[k], v) for b in buckets for k, v in b.items())
    finally:
        staging.close()


# ----- logging -----
@pytest.mark.benchmark(group="logging")
@pytest.mark.parametrize("route", ["lightning", "patched"])
def test_log_one_step(benchmark, route):
    """What ``self.log`` costs Lightning's result collection for one step of ~50 metrics (about what a default step
    logs), with Lightning's own ``_ResultMetric.to`` and with ``lightning_compat``'s short-cut."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    from molt_lightning.trainer import lightning_compat

    values = {f"m/{i}": torch.tensor(float(i)) for i in range(50)}
    results = _ResultCollection(training=True)

    def log_step():
        for name, value in values.items():
            results.log("training_step", name, value, on_step=True, on_epoch=False, batch_size=1)

    (lightning_compat.unpatch if route == "lightning" else lightning_compat.patch)()
    try:
        benchmark(log_step)
    finally:
        lightning_compat.patch()
    assert {k: float(v) for k, v in results.metrics(on_step=True)["callback"].items()} == \
        {k: float(v) for k, v in values.items()}
