"""Mixture-of-experts policies: the torch engine's routing capture, the routing record on spans and batches, routing
replay (R3) in the trainer's forward, the loop end to end on the tiny MoE, and the clear errors."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

from molt_lightning.policies import moe
from molt_lightning.engines import TorchEngine
from molt_lightning.engines.base import Sampling
from molt_lightning.trainer.policy import Policy
from molt_lightning.trajectory import Kind, Span, Trajectory, collate, place_routing

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from invariant import Batches, check_trained_tokens, record_generations  # noqa: E402

X = moe.NO_RECORD


@pytest.fixture(scope="module")
def moe_lm(moe_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32).eval()


PROMPTS = [[1, 40, 41, 42, 43, 44, 45, 46], [1, 50, 51], [1, 60, 61, 62, 63]]  # unequal: the engine left-pads


def generate_all(engine: TorchEngine, prompts, max_tokens=12):
    async def run():  # concurrent requests: one left-padded batch in the engine
        return await asyncio.gather(*(engine.generate(p, Sampling(max_tokens=max_tokens, ignore_eos=True, seed=i))
                                      for i, p in enumerate(prompts)))

    return engine.call(run())


def hf_routing(lm, ids: list[int]) -> torch.Tensor:
    """The experts HF's own routers choose for the full sequence, one forward: (T, layers, k)."""
    capture = moe.RoutingCapture(lm)
    try:
        with torch.no_grad():
            lm(input_ids=torch.tensor([ids]))
        return capture.take(1, len(ids))[0]
    finally:
        capture.remove()


def test_engine_routing_equals_hf_routers_on_the_full_sequence(moe_path, moe_lm):
    engine = TorchEngine(seed=0)
    engine.launch(moe_path)
    try:
        outs = generate_all(engine, PROMPTS)
    finally:
        engine.release()
    layers, k = moe_lm.config.num_hidden_layers, moe_lm.config.num_experts_per_tok
    for prompt, out in zip(PROMPTS, outs):
        assert out.routing.dtype == torch.int16
        assert out.routing.shape == (len(prompt) + len(out.token_ids) - 1, layers, k)  # the last token: no row
        hf = hf_routing(moe_lm, prompt + out.token_ids)[:-1]  # (T-1, layers, k)
        assert torch.equal(out.routing.sort(-1).values, hf.sort(-1).values)


def test_dense_engine_returns_no_routing(policy_path):
    engine = TorchEngine(seed=0)
    engine.launch(policy_path)
    try:
        assert all(o.routing is None for o in generate_all(engine, PROMPTS[:1], max_tokens=3))
    finally:
        engine.release()


def rows(*experts) -> torch.Tensor:
    """Routing rows (n, 1 layer, k=2) from (a, b) expert pairs; None for a row without a record."""
    return torch.tensor([[[X, X]] if e is None else [list(e)] for e in experts], dtype=torch.int16)


def test_spans_keep_each_positions_first_record_over_turns_and_collate_marks_the_rest():
    """Turn 1: prompt [5, 6], generated [7, 8]; the engine forwarded 5, 6, 7 (not 8). Turn 2 appends env [9] and
    generates [10]: its prefill routes 5..9 again, differently (another batch), and must not overwrite 5, 6, 7; token
    8 gets its row from that prefill; 10, the last generated token, has none."""
    seg = [Span.context(Kind.PROMPT, [5, 6]), Span.policy([7, 8], [-0.1, -0.2], [0, 0])]
    place_routing(seg, rows((0, 1), (2, 3), (4, 5)))  # turn 1: positions 0-2
    assert torch.equal(seg[1].routing, rows((4, 5), None))
    seg += [Span.context(Kind.ENV, [9]), Span.policy([10], [-0.3], [1])]
    place_routing(seg, rows((7, 6), (7, 6), (7, 6), (1, 2), (3, 4)))  # turn 2's prefill: positions 0-4
    assert torch.equal(seg[0].routing, rows((0, 1), (2, 3)))  # first record kept
    assert torch.equal(seg[1].routing, rows((4, 5), (1, 2)))  # token 8: from turn 2's prefill
    assert torch.equal(seg[2].routing, rows((3, 4))) and torch.equal(seg[3].routing, rows(None))
    short = [Span.context(Kind.PROMPT, [11]), Span.policy([12], [-0.4], [1])]
    place_routing(short, rows((6, 7)))
    b = collate([Trajectory(0, 0, [seg], reward=1.0), Trajectory(1, 0, [short], reward=0.0)], pad_id=0)
    assert b.routing.dtype == torch.int16 and b.routing.shape == (2, 6, 1, 2)  # (N, T, layers, k)
    assert b.routing[0, :, 0].tolist() == [[0, 1], [2, 3], [4, 5], [1, 2], [3, 4], [X, X]]
    assert b.routing[1, :, 0].tolist() == [[6, 7]] + [[X, X]] * 5  # the last token and the padding: no record
    dense = [Span.context(Kind.PROMPT, [11]), Span.policy([12], [-0.4], [1])]
    assert collate([Trajectory(0, 0, [dense], reward=1.0)], pad_id=0).routing is None


def test_routing_rows_must_match_the_span():
    from molt_lightning.trajectory import ConsistencyError

    span = Span.policy([7, 8], [-0.1, -0.2], [0, 0])
    span.routing = rows((1, 2))
    with pytest.raises(ConsistencyError, match="routing rows"):
        collate([Trajectory(0, 0, [[Span.context(Kind.PROMPT, [5]), span]], reward=1.0)], pad_id=0)


def tie_experts(lm, eps: float) -> dict[str, torch.Tensor]:
    """Layer 0's router with its least used expert's row set to its most used one's times (1 + eps) (usage on the
    test's prompts): an exact tie at eps = 0, contested wherever the most used expert comes second."""
    used = torch.bincount(torch.cat([hf_routing(lm, p)[:, 0].reshape(-1).long() for p in PROMPTS]),
                          minlength=lm.config.num_experts)  # (E,)
    a, b = int(used.argmax()), int(used.argmin())
    state = {k: v.clone() for k, v in lm.state_dict().items()}
    name = next(n for n in state if n.endswith("layers.0.mlp.gate.weight"))
    state[name][b] = state[name][a] * (1 + eps)
    return state


def test_replay_matches_the_engines_logprobs_where_free_routing_does_not(moe_path, moe_lm):
    """THE key property. The engine serves a policy whose layer-0 router ties two experts a and b exactly (b's row
    is a's); the trainer holds the same policy with b's row scaled by 1 + 1e-6. On this CPU, batched/padded and
    incremental numerics alone rarely flip a tie reproducibly, so the disagreement is forced deterministically:
    wherever a and b compete for the last top-k slot, the trainer's free router picks b where a's logit is positive
    and a where it is negative, the engine whichever its exact tie gave. Free routing then runs other experts on
    those positions (logprobs off by far more than 1e-4); replaying the engine's experts gives the engine's logprobs
    (1e-4), because the combine weights, live softmax of the trainer's logits, move by ~1e-6 only."""
    from transformers import AutoModelForCausalLM

    engine = TorchEngine(seed=0)
    engine.launch(moe_path)
    try:
        engine.call(engine.update_weights(tie_experts(moe_lm, 0.0), version=0))
        outs = generate_all(engine, PROMPTS, max_tokens=24)
    finally:
        engine.release()
    trajs = []
    for i, (prompt, out) in enumerate(zip(PROMPTS, outs)):
        seg = [Span.context(Kind.PROMPT, prompt), Span.policy(out.token_ids, out.logprobs, out.versions)]
        place_routing(seg, out.routing)
        trajs.append(Trajectory(i, 0, [seg], reward=1.0))
    b = collate(trajs, pad_id=0)
    trainer_lm = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32).eval()
    trainer_lm.load_state_dict(tie_experts(moe_lm, 1e-6))
    mask, engine_lp = b.loss_mask[:, 1:], b.engine_logprobs[:, 1:]
    diffs = {}
    for mode in ("free", "replay"):
        with torch.no_grad():
            out = Policy(trainer_lm, routing=mode).outputs(b.input_ids, b.attention_mask, b.loss_mask, 1.0,
                                                          routing=b.routing)
        diffs[mode] = (out.logprobs - engine_lp)[mask].abs()
    assert out.router_metrics["moe/agree_l0"] < 1.0  # the free router disagreed with the engine on layer 0
    assert diffs["free"].max() > 1e-4
    assert diffs["replay"].max() < 1e-4


def test_replay_routes_unrecorded_positions_freely_and_keeps_the_router_learning(moe_lm):
    ids = torch.tensor([[1, 40, 41, 42, 43]])
    attn, loss_mask = torch.ones_like(ids, dtype=torch.bool), torch.tensor([[0, 1, 1, 1, 1]], dtype=torch.bool)
    layers, k = moe_lm.config.num_hidden_layers, moe_lm.config.num_experts_per_tok
    unrecorded = torch.full((1, 5, layers, k), X, dtype=torch.int16)
    free = Policy(moe_lm, routing="free").outputs(ids, attn, loss_mask, 1.0)
    replay = Policy(moe_lm, routing="replay").outputs(ids, attn, loss_mask, 1.0, routing=unrecorded)
    assert torch.allclose(free.logprobs, replay.logprobs, atol=1e-6)  # no record anywhere: free routing
    forced = torch.zeros((1, 5, layers, k), dtype=torch.int16)
    forced[..., 1] = 1  # every position through experts 0 and 1
    out = Policy(moe_lm, routing="replay", router_aux_coef=0.01).outputs(ids, attn, loss_mask, 1.0, routing=forced)
    assert (out.logprobs - free.logprobs)[loss_mask[:, 1:]].abs().max() > 1e-3
    (out.logprobs.sum() + out.aux_loss).backward()
    routers = moe.routers(moe_lm)
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers)
    assert out.router_metrics["moe/load_violation_max"] == pytest.approx(8 / 2 - 1)  # 2 of 8 experts take it all
    assert float(out.router_metrics["moe/aux_loss"]) > 0
    assert all(r.forward.__func__ is type(r).forward for r in routers)  # the hook is gone after the forward
    moe_lm.zero_grad()


def test_replay_on_a_dense_policy_or_an_engine_without_capture_is_a_clear_error(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    from modules import make_module

    from molt_lightning.engines import VLLMEngine

    dense = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ValueError, match="dense.*model.moe.routing: free"):
        Policy(dense, routing="replay")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    sparse = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=16, moe_intermediate_size=8, num_experts=4,
                                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
    sparse.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for routing in ("replay", "free"):  # free too: the recompute would skip the hook's records (CheckpointError)
        with pytest.raises(NotImplementedError, match="activation_checkpointing: false"):
            Policy(sparse, routing=routing)
    with pytest.raises(ValueError, match="VLLMEngine does not.*TorchEngine or VLLMEngine.capture_routing=True"):
        make_module(engine=VLLMEngine(), routing="replay")


def test_loop_with_replay_trains_on_exactly_the_engines_tokens_and_logprobs(moe_path, tmp_path, monkeypatch, tokenizer):
    """On-policy (max_lag=0) so the engine-trainer mismatch is numerics only: with replay it is ~0."""
    from test_loop import fit, make

    engine = TorchEngine(seed=0)
    records = record_generations(engine, monkeypatch)
    batches = Batches()
    _, df = fit(make(engine, policy=moe_path, max_lag=0, routing="replay", aux_coef=0.01), tmp_path, steps=3,
                callbacks=[batches])
    assert check_trained_tokens(records, batches, tokenizer, max_lag=0) > 0  # multi-turn rows were checked
    assert (df["mismatch/abs_logprob_diff"].dropna() < 1e-4).all()
    assert ((df["is/ratio_max"].dropna() - 1).abs() < 1e-3).all()
    for name in ("moe/agree_l0", "moe/agree_l1", "moe/load_violation_max", "moe/aux_loss"):
        assert df[name].notna().any(), name
    for _, b in batches.seen:  # every real position has a record but each row's last token (never forwarded)
        for row in range(b.input_ids.shape[0]):
            n = int(b.attention_mask[row].sum())
            assert (b.routing[row, : n - 1] >= 0).all() and (b.routing[row, n - 1:] == X).all()


@pytest.mark.slow
def test_moe_recipe_parses_and_trains(tmp_path):
    from test_cli import fit_recipe

    _, _, config, df = fit_recipe("moe", tmp_path)
    assert "routing: replay" in config and "TorchEngine" in config and "moe_policy" in config
    assert df["moe/agree_l1"].notna().any()


@pytest.mark.slow
def test_vllm_engine_captures_the_routing_hf_computes_and_reloads_experts(vllm_moe_engine, moe_lm):
    """vLLM (CPU, eager) through the worker extension: concurrent requests' captured routing equals HF's routers on
    the full sequences; after a weight update (expert weights changed) the engine's logprobs follow the new weights
    (the CPU MoE kernel's packing is re-run after a reload)."""
    engine = vllm_moe_engine
    try:
        outs = generate_all(engine, PROMPTS * 2)
        for prompt, out in zip(PROMPTS * 2, outs):
            hf = hf_routing(moe_lm, prompt + out.token_ids)[:-1]  # (T-1, layers, k)
            assert torch.equal(out.routing.sort(-1).values, hf.sort(-1).values)
        new = {k: v * 1.5 if ".experts." in k else v for k, v in moe_lm.named_parameters()}
        engine.call(engine.update_weights(new, version=1))
        [out] = generate_all(engine, PROMPTS[:1])
    finally:  # the session's engine goes back
        engine.call(engine.update_weights({k: v.detach() for k, v in moe_lm.named_parameters()}, version=0))
    lm = type(moe_lm)(moe_lm.config).eval()
    lm.load_state_dict({k: v.detach() for k, v in new.items()}, strict=False)
    lm.tie_weights()
    ids = torch.tensor([PROMPTS[0] + out.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(lm(input_ids=ids).logits[0, len(PROMPTS[0]) - 1:-1].float(), -1)  # (n, V)
    expected = logp.gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4)
    assert torch.equal(out.routing.sort(-1).values, hf_routing(lm, ids[0].tolist())[:-1].sort(-1).values)


@pytest.mark.slow
def test_moe_vllm_recipe_parses(capsys):
    from test_cli import ROOT

    from molt_lightning.commands.cli import main

    with pytest.raises(SystemExit) as stop:  # molt fit in this process: --print_config prints and exits 0
        main(["fit", "--config", str(ROOT / "recipes/moe_vllm.yaml"), "--print_config"])
    out = capsys.readouterr().out
    assert stop.value.code == 0 and "capture_routing: true" in out and "routing: replay" in out
