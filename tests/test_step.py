"""The memory-bounded step: chunked logprobs/entropy equal the full-logits ones; the batch plan gives ranks whole,
disjoint groups and respects the token budget; micro-batched, rank-split gradients equal the whole batch's in every
aggregation mode (the normalizers are the mini-batch's, not each part's)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from molt_lightning.algorithms import AGGREGATIONS, AdvantageInputs, Algorithm
from molt_lightning.algorithms.objective import Norm
from molt_lightning.trainer.plan import pack, plan, rank_rows
from molt_lightning.trainer.policy import Policy, logprobs_and_entropy
from molt_lightning.trajectory import Kind, Span, Trajectory, collate

VOCAB = 61


def tiny_lm(seed=0, tie=True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tie, pad_token_id=0)
    return LlamaForCausalLM(cfg).float()


def synthetic_batch(groups=4, group_size=3, seed=0):
    """Trajectories of varied length: a prompt, a policy span, sometimes a tool turn and a second policy span."""
    rng = random.Random(seed)
    trajs = []
    for g in range(groups):
        for _ in range(group_size):
            spans = [Span.context(Kind.PROMPT, [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 6))])]
            for turn in range(rng.randint(1, 2)):
                if turn:
                    spans.append(Span.context(Kind.ENV, [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 3))]))
                n = rng.randint(1, 7)
                spans.append(Span.policy([rng.randrange(1, VOCAB) for _ in range(n)],
                                         [-rng.random() * 3 for _ in range(n)], [0] * n))
            trajs.append(Trajectory(sample_id=g, group_id=g, segments=[spans], reward=float(rng.random() > 0.5)))
    return collate(trajs, pad_id=0, max_version=0)


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_logprobs_and_entropy_equal_full_logits(entropy_grad):
    lm = tiny_lm(tie=False)
    batch = synthetic_batch()
    policy = Policy(lm, chunk_tokens=5)  # several chunks, the last one partial
    args = (batch.input_ids, batch.attention_mask, batch.loss_mask, 0.7)
    out = policy.outputs(*args, entropy_grad=entropy_grad)
    logits = lm(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long()).logits  # (N, T, V)
    ref_lp, ref_ent = logprobs_and_entropy(logits, batch.input_ids, 0.7, entropy_grad=entropy_grad)
    mask = batch.loss_mask[:, 1:]
    assert torch.allclose(out.logprobs[mask], ref_lp[mask], atol=1e-6)
    assert torch.allclose(out.entropy[mask], ref_ent[mask], atol=1e-6)
    assert (out.logprobs[~mask] == 0).all()

    w = torch.randn(mask.shape)  # any function of the masked values: gradients must agree too
    grads = []
    for lp, ent in [(out.logprobs, out.entropy), (ref_lp, ref_ent)]:
        lm.zero_grad()
        (torch.where(mask, w * lp + (w * ent if entropy_grad else 0), 0.0)).sum().backward()
        grads.append({n: p.grad.clone() for n, p in lm.named_parameters()})
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-6), n


def test_plan_gives_ranks_whole_disjoint_groups_within_the_budget():
    batch = synthetic_batch(groups=5, group_size=3)
    lengths = batch.attention_mask.sum(-1).tolist()
    per_rank = rank_rows(batch, world=2)
    groups = [{int(batch.group_ids[r]) for r in rows} for rows in per_rank]
    assert not groups[0] & groups[1] and groups[0] | groups[1] == set(range(5))  # disjoint, together the batch
    for rows, gs in zip(per_rank, groups):  # whole groups
        assert len(rows) == 3 * len(gs)
    budget = max(lengths) + 3
    plans = [plan(batch, 2, rank, mini_batches=2, micro_batch_tokens=budget) for rank in range(2)]
    for j in range(2):
        assert len(plans[0][j].micro) == len(plans[1][j].micro)  # the ranks' collectives line up
        assert plans[0][j].norm == plans[1][j].norm
        for p in plans:
            for rows in p[j].micro:
                assert len(rows) * max((lengths[r] for r in rows), default=0) <= budget
    seen = sorted(r for p in plans for mb in p for rows in mb.micro for r in rows)
    assert seen == list(range(len(lengths)))  # every row exactly once


def test_plan_errors_name_the_fix():
    batch = synthetic_batch(groups=2)
    with pytest.raises(ValueError, match="raise prompts_per_step to at least 3"):
        rank_rows(batch, world=3)
    with pytest.raises(ValueError, match="micro_batch_tokens=2 is smaller than one sequence"):
        pack([0, 1], batch.attention_mask.sum(-1).tolist(), 2)
    with pytest.raises(ValueError, match="lower mini_batches"):
        plan(batch, 1, 0, mini_batches=100)


def _module(lm, algo):
    from modules import make_module

    m = make_module(algo=algo)
    m.policy = Policy(lm, chunk_tokens=4)
    return m


def _grads(module, batch, parts):
    """Gradients of the sum of ``micro_loss`` over ``parts``: [(rows, norm, scale)]."""
    algo = module.algo
    trajs = batch.trajectories
    rewards = torch.tensor([t.reward for t in trajs])
    groups = torch.tensor([t.group_id for t in trajs])
    est = module.fns.advantage(AdvantageInputs(rewards, groups, batch.traj_ids, batch.loss_mask[:, 1:]), algo)
    from molt_lightning.trainer.plan import Constants

    module.policy.zero_grad()
    for rows, norm, scale in parts:
        loss, _, _ = module.micro_loss(batch, rows, est, Constants(), norm)
        (loss * scale).backward()
    return {n: p.grad.clone() for n, p in module.policy.named_parameters()}


@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
def test_micro_batches_and_ranks_give_the_whole_batch_gradient(aggregation):
    algo = Algorithm(aggregation=aggregation, loss_norm_tokens=8, entropy_coef=0.01)
    batch = synthetic_batch(groups=4, group_size=3, seed=1)
    module = _module(tiny_lm(seed=1), algo)
    n = batch.input_ids.shape[0]
    whole = _grads(module, batch, [(list(range(n)), Norm.of(batch.loss_mask[:, 1:]), 1.0)])
    budget = int(batch.attention_mask.sum(-1).max()) + 2
    for world in (1, 2):  # DDP/FSDP2 average the ranks' gradients of loss * world: the sum of the parts' losses
        parts = [(rows, mb.norm, 1.0) for rank in range(world)
                 for mb in plan(batch, world, rank, micro_batch_tokens=budget) for rows in mb.micro if rows]
        assert len(parts) > world  # really split
        split = _grads(module, batch, parts)
        for name in whole:
            assert torch.allclose(whole[name], split[name], atol=1e-5), (world, name)


def test_activation_checkpointing_gives_the_same_gradient():
    batch = synthetic_batch(seed=2)
    grads = []
    for ckpt in (False, True):
        lm = tiny_lm(seed=3)
        if ckpt:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        lm.train()
        out = Policy(lm, chunk_tokens=8).outputs(batch.input_ids, batch.attention_mask, batch.loss_mask, 1.0)
        out.logprobs.sum().backward()
        grads.append({n: p.grad for n, p in lm.named_parameters()})
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-6), n


def test_bad_setups_are_refused_with_the_fix():
    from types import SimpleNamespace

    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning.pytorch.strategies import DDPStrategy

    from molt_lightning.trainer.policy import check_vocab
    from molt_lightning.trainer.parallel import check_strategy

    cores = len(__import__("os").sched_getaffinity(0))
    trainer = SimpleNamespace(strategy=DDPStrategy(), accelerator=CPUAccelerator(), num_devices=cores + 1,
                              world_size=cores + 1, precision="32-true")
    with pytest.raises(ValueError, match=f"use --trainer.devices {cores} or fewer"):
        check_strategy(trainer)
    trainer.num_devices, trainer.world_size = cores, 2 * cores  # two nodes, each with a process per core: fine
    check_strategy(trainer)
    trainer.strategy = SimpleNamespace()  # e.g. DeepSpeed, FSDP1
    with pytest.raises(ValueError, match="not supported by AsyncRLModule: use auto"):
        check_strategy(trainer)

    config = SimpleNamespace(vocab_size=100)
    with pytest.raises(ValueError, match="resize the embeddings"):
        check_vocab(config, [0] * 101)
    with pytest.raises(ValueError, match="start the engine from the policy's own folder"):
        check_vocab(config, [0] * 100, SimpleNamespace(vocab_size=128))
    check_vocab(config, [0] * 90, SimpleNamespace(vocab_size=100))  # a tokenizer smaller than the embeddings is fine


def test_bf16_on_a_cpu_that_emulates_it_is_warned_with_the_fix(monkeypatch, caplog):
    """bf16 autocast on an AVX2-only CPU made SmolLM2's training step 14x slower: the run says so and names the fix.
    ``native_bf16`` agrees with the kernel's CPU flags (/proc/cpuinfo), an independent reading."""
    from types import SimpleNamespace

    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from molt_lightning.trainer import parallel

    trainer = SimpleNamespace(strategy=SingleDeviceStrategy("cpu"), accelerator=CPUAccelerator(), num_devices=1,
                              world_size=1)
    for native, precision, warned in ((False, "bf16-mixed", True), (False, "bf16-true", True),
                                      (True, "bf16-mixed", False), (False, "32-true", False)):
        monkeypatch.setattr(parallel, "native_bf16", lambda: native)
        caplog.clear()
        trainer.precision = precision
        with caplog.at_level("WARNING", logger=parallel.__name__):
            parallel.check_strategy(trainer)
        assert ("use --trainer.precision 32-true" in caplog.text) is warned, (native, precision, caplog.text)
    monkeypatch.undo()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists() and __import__("platform").machine() == "x86_64":
        flags = set(next(x for x in cpuinfo.read_text().splitlines() if x.startswith("flags")).split())
        assert parallel.native_bf16() == bool(flags & {"avx512_bf16", "amx_bf16", "amx_tile"})
