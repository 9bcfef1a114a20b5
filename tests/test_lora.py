"""LoRA through peft (``model.lora``): both engines serve the adapter exactly as HF's ``PeftModel`` computes it after
every sync, the adapter really changes what they generate, only adapter parameters train, a sync carries exactly the
adapter's bytes, the loop's consistency invariant holds, vLLM retires old adapters, and bad input names the fix.
The ``slow`` tests share one LoRA-enabled vLLM engine for this module."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest
import torch

from molt_lightning.policies import lora
from molt_lightning.engines import Sampling, TorchEngine

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from invariant import Batches, check_trained_tokens, record_generations  # noqa: E402
from test_engines import generate_all, prompts  # noqa: E402,F401  (the shared prompt fixture)
from test_loop import fit, make  # noqa: E402

from modules import LORA  # noqa: E402  (the session's LoRA engine serves this adapter)

SPEC = lora.LoraSpec(**LORA)


@pytest.fixture
def peft_lm(lora_lm):
    """The HF PeftModel every engine is checked against (and whose adapter config the engines serve)."""
    return lora_lm


@pytest.fixture
def adapter(peft_lm):
    return lora.adapter_of(peft_lm)


def adapter_states(peft_lm) -> list[dict[str, torch.Tensor]]:
    """Version 0 (peft's init: B = 0, the base model) and two random adapters with B != 0."""
    from peft import get_peft_model_state_dict

    fresh = {k: v.clone() for k, v in get_peft_model_state_dict(peft_lm).items()}
    states = [fresh]
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        states.append({k: torch.randn(v.shape, generator=g) * (0.3 if "lora_B" in k else 0.2)
                       for k, v in fresh.items()})
    return states


def hf_logprobs(peft_lm, state, prompt, tokens):
    """Log-softmax logprob of each token (T=1) and whether it is the argmax, under ``state`` in HF's PeftModel."""
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(peft_lm, state)
    with torch.no_grad():
        logits = peft_lm(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1].double()  # (T, V)
    lp = torch.log_softmax(logits, -1)  # (T, V)
    tok = torch.tensor(tokens)  # (T,)
    return lp.gather(-1, tok[:, None]).squeeze(-1), bool((lp.argmax(-1) == tok).all())


def check_engine_serves_each_adapter(engine, prompts, peft_lm):  # noqa: F811
    """(a) after each sync the greedy outputs and logprobs equal HF PeftModel's (1e-4); (b) a non-zero adapter
    changes the outputs (version 0 is the base model)."""
    greedy = Sampling(max_tokens=16, temperature=0.0)
    outputs = []
    for version, state in enumerate(adapter_states(peft_lm)):
        engine.call(engine.update_weights(state, version))
        outs = generate_all(engine, prompts, greedy)
        for p, o in zip(prompts, outs):
            assert set(o.versions) == {version}
            ref, is_greedy = hf_logprobs(peft_lm, state, p, o.token_ids)
            assert is_greedy, f"version {version}: the engine's greedy tokens are not HF PeftModel's"
            assert torch.allclose(torch.tensor(o.logprobs, dtype=torch.float64), ref, atol=1e-4)
        outputs.append([o.token_ids for o in outs])
    assert outputs[1] != outputs[0] and outputs[2] != outputs[1], "the synced adapter did not change the outputs"


@pytest.mark.slow
def test_torch_engine_serves_the_synced_adapter(policy_path, adapter, prompts, peft_lm):  # noqa: F811
    engine = TorchEngine(seed=0)
    engine.launch(policy_path, adapter)
    try:
        check_engine_serves_each_adapter(engine, prompts, peft_lm)
    finally:
        engine.release()


@pytest.mark.slow
def test_vllm_engine_serves_the_synced_adapter_and_retires_old_ones(vllm_lora_engine, prompts, peft_lm):  # noqa: F811
    engine = vllm_lora_engine
    check_engine_serves_each_adapter(engine, prompts, peft_lm)
    slots = engine.adapters
    loaded = set(engine.call(engine.llm.list_loras()))
    assert loaded == {slots.current.request.lora_int_id}  # nothing in flight: only the newest adapter is loaded
    assert slots.retired >= 2 and os.path.isdir(slots.current.folder)
    assert sorted(os.listdir(slots.current.folder)) == ["adapter_config.json", "adapter_model.safetensors"]


async def held_by_vllm(engine, n: int) -> None:
    """Return once vLLM holds ``n`` unfinished requests (deadline 120 s)."""
    deadline = asyncio.get_running_loop().time() + 120
    while engine.llm.output_processor.get_num_unfinished_requests() < n:
        assert asyncio.get_running_loop().time() < deadline, f"vLLM did not receive {n} requests within 120 s"
        await asyncio.sleep(0.01)


@pytest.mark.slow
def test_vllm_request_in_flight_keeps_its_adapter(vllm_lora_engine, prompts, peft_lm):  # noqa: F811
    """A request started under adapter v finishes under it, every token tagged v, even when v+1 lands meanwhile;
    v's folder goes once its last request ends. The scheduler is held (vLLM's own pause) from before the requests
    start until v+1 is loaded, so every request is in flight during the update."""
    engine, (_, s1, s2) = vllm_lora_engine, adapter_states(peft_lm)
    long = Sampling(max_tokens=100, temperature=1.0, ignore_eos=True)

    async def scenario():
        await engine.update_weights(s1, 21)
        old = engine.adapters.current
        await engine.llm.pause_generation(mode="keep", clear_cache=False)
        try:
            tasks = [asyncio.ensure_future(engine.generate(p, long)) for p in prompts]
            await held_by_vllm(engine, len(tasks))
            await engine.update_weights(s2, 22)
            in_flight = sum(not t.done() for t in tasks)
        finally:
            await engine.llm.resume_generation()
        after = await engine.generate(prompts[0], Sampling(max_tokens=8, temperature=0.0))
        outs = await asyncio.gather(*tasks)
        return in_flight, old, outs, after

    in_flight, old, outs, after = engine.call(scenario())
    assert in_flight == len(prompts)
    assert set(after.versions) == {22}
    for p, o in list(zip(prompts, outs))[:4]:
        assert set(o.versions) == {21}
        ref, _ = hf_logprobs(peft_lm, s1, p, o.token_ids)
        assert torch.allclose(torch.tensor(o.logprobs, dtype=torch.float64), ref, atol=1e-3)
    assert not os.path.exists(old.folder)  # retired once its requests finished
    assert set(engine.call(engine.llm.list_loras())) == {engine.adapters.current.request.lora_int_id}


@pytest.mark.slow
def test_vllm_three_adapters_in_use_beyond_max_loras(vllm_lora_engine, prompts, peft_lm):  # noqa: F811
    """Requests of three adapter versions in flight at once, with max_loras = max_cpu_loras = 2: vLLM evicts one
    from its cache while it is in use and reloads it from its folder (still there: in use); every request finishes
    under its own adapter, and the two older adapters go once their requests are done. The scheduler is held (vLLM's
    own pause) while the three waves arrive, so all three are in flight when it resumes."""
    engine, (s0, s1, s2) = vllm_lora_engine, adapter_states(peft_lm)
    long = Sampling(max_tokens=80, temperature=1.0, ignore_eos=True)

    async def scenario():
        waves, folders = [], []
        await engine.llm.pause_generation(mode="keep", clear_cache=False)
        try:
            for version, state in ((31, s1), (32, s2), (33, s0)):
                await engine.update_weights(state, version)
                folders.append(engine.adapters.current.folder)
                waves.append([asyncio.ensure_future(engine.generate(p, long)) for p in prompts[:4]])
                await held_by_vllm(engine, 4 * len(waves))
            in_flight = [sum(not t.done() for t in wave) for wave in waves]
        finally:
            await engine.llm.resume_generation()
        return in_flight, folders, [await asyncio.gather(*wave) for wave in waves]

    in_flight, folders, waves = engine.call(scenario())
    assert in_flight == [4, 4, 4]
    for (version, state), outs in zip(((31, s1), (32, s2), (33, s0)), waves):
        for p, o in list(zip(prompts, outs))[:2]:
            assert set(o.versions) == {version}
            ref, _ = hf_logprobs(peft_lm, state, p, o.token_ids)
            assert torch.allclose(torch.tensor(o.logprobs, dtype=torch.float64), ref, atol=1e-3), version
    assert not os.path.exists(folders[0]) and not os.path.exists(folders[1]) and os.path.isdir(folders[2])
    assert set(engine.call(engine.llm.list_loras())) == {engine.adapters.current.request.lora_int_id}


def lora_fit(engine, tmp_path, monkeypatch, policy_path, **kw):
    """A short LoRA run: (c) base weights bit-identical, only adapter parameters trained and in the optimizer;
    (d) the consistency invariant and ``perf/sync_bytes`` = the adapter's bytes."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    records, batches = record_generations(engine, monkeypatch), Batches()
    module = make(engine, lora=SPEC, **kw)
    _, df = fit(module, tmp_path, steps=3, callbacks=[batches])
    check_trained_tokens(records, batches, module.tokenizer)

    base = load_file(f"{policy_path}/model.safetensors")
    lm = module.policy.lm
    for name, p in lm.get_base_model().named_parameters():
        if "lora_" not in name:
            key = name.replace(".base_layer", "")
            assert torch.equal(p, base[key]), f"base weight {key} changed"
    trained = get_peft_model_state_dict(lm)
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in trained.items())  # B left 0
    opt = {id(p) for g in module.optimizers().optimizer.param_groups for p in g["params"]}
    assert opt == {id(p) for n, p in lm.named_parameters() if "lora_" in n}
    adapter_bytes = sum(v.numel() * v.element_size() for v in trained.values())
    sync = df["perf/sync_bytes"].dropna()
    assert len(sync) == 3 and (sync == adapter_bytes).all()
    assert adapter_bytes < sum(v.numel() * v.element_size() for v in base.values())
    return df


@pytest.mark.slow
def test_lora_fit_on_the_torch_engine(tmp_path, monkeypatch, policy_path):
    lora_fit(TorchEngine(seed=0), tmp_path, monkeypatch, policy_path)


@pytest.mark.slow
def test_lora_max_lag_zero_is_on_policy(tmp_path):
    _, df = fit(make(TorchEngine(seed=0), lora=SPEC, max_lag=0), tmp_path, steps=2)
    assert ((df["is/ratio_min"] - 1).abs() < 1e-3).all() and ((df["is/ratio_max"] - 1).abs() < 1e-3).all()


@pytest.mark.slow
def test_lora_fit_on_the_vllm_engine(vllm_lora_engine, tmp_path, monkeypatch, policy_path):
    lora_fit(vllm_lora_engine, tmp_path, monkeypatch, policy_path)


@pytest.mark.slow
def test_lora_resumes_with_its_adapter(tmp_path):
    """A checkpoint holds the adapter (and the frozen base): the resumed run starts from the saved adapter, and the
    engine serves it (the first push after the resume carries it)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from peft import get_peft_model_state_dict

    first = make(TorchEngine(seed=0), lora=SPEC)
    fit(first, tmp_path, steps=2, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True,
                                                             every_n_train_steps=1)])
    def adapter_of(model):  # a copy: peft's state-dict tensors share the parameters' storage
        return {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}

    saved = adapter_of(first.policy.lm)

    class AtStart(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if not hasattr(self, "adapter"):
                self.adapter = adapter_of(pl_module.policy.lm)
                self.engine = adapter_of(pl_module.engine.model)

    at_start = AtStart()
    second = make(TorchEngine(seed=0), lora=SPEC)
    fit(second, tmp_path, steps=3, callbacks=[at_start], ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"), name="again")
    assert second.policy_version == 3
    assert any(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)
    for k, v in saved.items():
        assert torch.equal(at_start.adapter[k], v) and torch.equal(at_start.engine[k], v), k


# ----- (e) bad input -----

def test_target_modules_that_match_nothing_name_the_layers(policy_path):
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(policy_path)
    with pytest.raises(ValueError, match=r"matches no layer.*'q_proj'.*name some of those"):
        lora.apply(lm, lora.LoraSpec(target_modules=["attention"]))


@pytest.mark.parametrize("kw, message", [({"r": 0}, "model.lora.r"), ({"alpha": 0}, "model.lora.alpha"),
                                         ({"dropout": 1.0}, "model.lora.dropout"),
                                         ({"target_modules": []}, "target_modules is empty")])
def test_bad_lora_spec_is_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        lora.LoraSpec(**kw)


def test_engine_refuses_the_other_policy_kind_and_foreign_tensors(policy_path, adapter, peft_lm):
    engine = TorchEngine(seed=0)
    engine.launch(policy_path)  # full weights
    try:
        with pytest.raises(ValueError, match="give each policy kind its own engine"):
            engine.launch(policy_path, adapter)
        with pytest.raises(KeyError, match="must be launched with its adapter"):
            engine.call(engine.update_weights(adapter_states(peft_lm)[1], 1))
    finally:
        engine.release()


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp2_ep"])
def test_fsdp2_with_lora_is_refused_by_the_cli_before_anything_starts(tmp_path, capsys, strategy):
    from test_bad_inputs import ROOT, answer  # molt fit in this process: the error line, no traceback

    err = answer(capsys, "--config", str(ROOT / "recipes/lora.yaml"), "--trainer.strategy", strategy,
                 "--trainer.devices", "2", "--trainer.logger.init_args.save_dir", str(tmp_path))
    assert "model.lora with --trainer.strategy fsdp2 or fsdp2_ep is not supported" in err
    assert "use --trainer.strategy ddp" in err


def test_fsdp2_with_lora_is_refused(peft_lm):
    from lightning.pytorch.strategies import ModelParallelStrategy

    from molt_lightning.trainer import parallel
    from molt_lightning.trainer.policy import Policy

    with pytest.raises(ValueError, match="use --trainer.strategy ddp"):
        parallel.shard(Policy(peft_lm), ModelParallelStrategy())


@pytest.mark.slow
def test_lora_recipe_trains_through_the_cli(tmp_path, policy_path):
    """recipes/lora.yaml parses (model.lora becomes a LoraSpec) and trains; the sync carries the adapter only."""
    from test_cli import fit_recipe

    _, _, config, df = fit_recipe("lora", tmp_path, "--model.engine", "molt_lightning.engines.TorchEngine")
    assert "r: 8" in config
    full = os.path.getsize(f"{policy_path}/model.safetensors")
    sync = df["perf/sync_bytes"].dropna()
    assert len(sync) == 2 and (sync == sync.iloc[0]).all() and 0 < sync.iloc[0] < full / 2


def test_bad_lora_key_in_a_recipe_names_the_fix(tmp_path, capsys):
    from test_bad_inputs import ROOT, answer

    err = answer(capsys, "--config", str(ROOT / "recipes/lora.yaml"), "--model.engine",
                 "molt_lightning.engines.TorchEngine", "--model.lora.r", "0",
                 "--trainer.logger.init_args.save_dir", str(tmp_path))
    assert "model.lora.r must be between 1 and 512" in err
