"""The weight path every platform but vLLM's CPU one takes, run here: the CPU specializations off.

On a GPU a vLLM engine loads each sync through vLLM's own ``reload_weights`` and never calls ``engines/vllm/cpu.py``
(the direct load into oneDNN kernels, packing ahead, the repacks). CI has no GPU, so:
- with vLLM's platform faked as CUDA, the worker, the engine's phases and ``molt serve``'s command make no call into
  the CPU module (fast, no engine): only the question whether it applies is asked (``cpu.applies``, ``cpu.defaults``);
- on real vLLM on this CPU, the session's dense, LoRA and mixture-of-experts engines are switched to the generic load
  (``molt_open(direct=False)``, what every other platform answers) and a sync of new weights must verify by
  fingerprints and give logprobs equal to the trainer's model with those weights (1e-4). The CPU platform still needs
  its repacks after ``reload_weights`` (``cpu.after_reload``); they are the only CPU call left on this path.
"""

from __future__ import annotations

import asyncio
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from molt_lightning.engines import Sampling
from molt_lightning.trainer.weights import WeightFlow

sys.path.insert(0, str(Path(__file__).parent / "helpers"))

TRAINER = SimpleNamespace(global_rank=0, strategy=None)
PROMPTS = [[1, 40, 41, 42, 43, 44], [1, 50, 51], [1, 60, 61, 62, 63, 64, 65]]


# ----- the platform faked as CUDA: no call into the CPU module -----
@pytest.fixture
def fake_cuda(monkeypatch):
    """vLLM's platform answers "not the CPU"; every callable of ``cpu`` but the two questions (``applies``, and
    ``defaults``, which asks it) raises if called."""
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    from molt_lightning.engines.vllm import cpu

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    called = []
    for name in [n for n in vars(cpu) if not n.startswith("__") and n not in ("applies", "defaults")]:
        obj = getattr(cpu, name)
        if callable(obj) and getattr(obj, "__module__", None) == cpu.__name__:
            def poisoned(*args, _name=name, **kwargs):
                called.append(_name)
                raise AssertionError(f"cpu.{_name} called off the CPU platform")
            monkeypatch.setattr(cpu, name, poisoned)
    return called


class FakeWorker:
    """What ``MoltWorkerExtension`` reads of vLLM's worker: the model runner and ``reload_weights``."""

    def __init__(self):
        self.reloaded = []
        self.model_runner = SimpleNamespace(get_model=lambda: torch.nn.Linear(2, 2))

    def reload_weights(self, weights_iterator):
        self.reloaded += [name for name, _ in weights_iterator]


def test_off_the_cpu_the_worker_loads_through_vllms_own_reload(fake_cuda, tmp_path):
    import base64

    from safetensors.torch import save

    from molt_lightning.engines.vllm import shm
    from molt_lightning.engines.vllm.worker import MoltWorkerExtension

    worker = type("Worker", (FakeWorker, MoltWorkerExtension), {})()
    assert worker.molt_open(direct=True) is False  # direct wanted, but not the CPU platform
    staging = shm.Staging(str(tmp_path))
    try:
        slab = staging.write({"a.weight": torch.ones(2, 2), "m.mlp.experts.gate_up_proj": torch.ones(2, 4, 3)})
        out = worker.molt_load_slabs([slab.to_wire()], staging.paths, "token")
    finally:
        staging.close()
    assert out == {"tensors": 2, "packed_ahead": 0, "via": "reload_weights"}
    assert worker.reloaded[0] == "a.weight" and "m.mlp.experts.1.up_proj.weight" in worker.reloaded
    blob = base64.b64encode(save({"b.weight": torch.zeros(3)})).decode("ascii")
    assert worker.molt_load_weights_bytes([blob])["via"] == "reload_weights"
    assert fake_cuda == []


def test_off_the_cpu_the_engine_sends_no_packing_call_and_serve_picks_vllms_defaults(fake_cuda):
    from molt_lightning.engines.base import update
    from molt_lightning.engines.vllm import cpu
    from molt_lightning.engines.vllm.engine import VLLMEngine
    from molt_lightning.engines.vllm.server import server_command

    calls = []

    class LLM:  # what the weight phases call of AsyncLLM, recorded
        async def collective_rpc(self, method, args=()):
            calls.append(method)
            return [False] if method == "molt_open" else [{"tensors": 1, "packed_ahead": 0, "via": "reload_weights"}]

        async def reset_prefix_cache(self, reset_running_requests=False):
            calls.append("reset_prefix_cache")

        async def update_weight_version(self, version):
            calls.append(f"version {version}")

        async def resume_generation(self):
            calls.append("resume")

    engine = VLLMEngine()
    engine.llm = LLM()
    engine.llm.engine_core = SimpleNamespace(pause_scheduler_async=lambda **kw: asyncio.sleep(0, calls.append("pause")))

    async def sync():
        await engine._open_weights(engine.direct_load, engine.load_ahead)
        await engine.stage_weights({"big.weight": torch.zeros(2**21)})  # 8 MB: packed ahead on the CPU
        await update([engine], 1)

    try:
        asyncio.run(sync())
    finally:
        engine.staging.close()
    assert engine.ahead is None and not engine.direct
    assert calls == ["molt_open", "pause", "molt_load_slabs", "reset_prefix_cache", "version 1", "resume"]
    assert cpu.defaults() == {}  # the dtype and eager mode are vLLM's own choice
    cmd = server_command("/policy", "127.0.0.1", 8000)
    assert "--enforce-eager" not in cmd and "--dtype" not in cmd and "--worker-extension-cls" in cmd
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]  # vLLM's own server, its own executor
    assert fake_cuda == []


def test_on_the_cpu_serve_pins_float32_and_eager_unless_told():
    pytest.importorskip("vllm")
    from molt_lightning.engines.vllm.server import server_command

    cmd = server_command("/policy", "127.0.0.1", 8000)
    assert cmd[cmd.index("--dtype") + 1] == "float32" and "--enforce-eager" in cmd
    assert cmd[1:3] == ["-m", "molt_lightning.engines.vllm.server"]  # server.main: the worker in the engine core
    cmd = server_command("/policy", "127.0.0.1", 8000, ["--dtype", "bfloat16"])
    assert cmd.count("--dtype") == 1 and cmd[cmd.index("--dtype") + 1] == "bfloat16"


def test_serve_answers_to_the_folder_policy_and_the_folders_name():
    """`molt serve --policy runs/x/out/`: vLLM's own parser reads the folder as given (first: the name in responses),
    `policy` (what docs/agents.md's clients send) and `out` as the served names; one given after `--` wins."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from molt_lightning.engines.vllm.server import server_command

    parse = make_arg_parser(FlexibleArgumentParser()).parse_args
    args = parse(server_command("runs/x/out/", "127.0.0.1", 8000, ["--max-model-len", "512"])[3:])
    assert args.model == "runs/x/out/" and args.served_model_name == ["runs/x/out/", "policy", "out"]
    args = parse(server_command("runs/x/out/", "127.0.0.1", 8000, ["--served-model-name", "mine"])[3:])
    assert args.served_model_name == ["mine"]


# ----- real vLLM on this CPU, on the generic path -----
@contextmanager
def generic_load(engine):
    """The engine's workers load through ``reload_weights`` while the block runs (what another platform answers)."""
    engine.call(engine._open_weights(False, engine.load_ahead))
    assert not engine.direct and engine.ahead is None
    try:
        yield
    finally:
        engine.call(engine._open_weights(engine.direct_load, engine.load_ahead))


def push(engine, state, version) -> WeightFlow:
    flow = WeightFlow(engine, verify=True)

    class Weights(torch.nn.Module):
        def named_parameters(self, *a, **kw):
            return ((k, torch.nn.Parameter(v, requires_grad=False)) for k, v in state.items())

    flow.push(Weights(), version, TRAINER, 200_000)
    flow.settle()
    return flow


def changed(state, seed, scale=0.02):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in state.items()}


def engine_matches(engine, lm, version):
    """The engine's sampled tokens (T=1) carry ``version`` and their logprobs equal ``lm``'s, teacher-forced."""
    async def all_():
        return await asyncio.gather(*[engine.generate(p, Sampling(max_tokens=12, temperature=1.0)) for p in PROMPTS])

    for prompt, out in zip(PROMPTS, engine.call(all_())):
        assert set(out.versions) == {version}
        with torch.no_grad():
            logits = lm(input_ids=torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1].double()
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(out.logprobs, dtype=torch.float64), ref, atol=1e-4)


def trainer_weights(path) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The policy as the trainer holds it, and its parameters by the names a sync sends (a MoE layer's experts fused,
    as transformers 5 holds them: the worker splits them per expert for vLLM's loader)."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return lm, {k: v.detach().clone() for k, v in lm.named_parameters()}


def with_weights(lm, state):
    lm.load_state_dict(state, strict=False)  # every parameter (tied ones are one)
    lm.tie_weights()
    return lm


@pytest.mark.slow
def test_dense_policy_on_the_generic_load(vllm_engine, policy_path):
    lm, base = trainer_weights(policy_path)
    new = changed(base, seed=11)
    try:
        with generic_load(vllm_engine):
            flow = push(vllm_engine, new, 3)
            assert flow.verified  # every tensor read back, through its kernel
            assert {r["via"] for r in vllm_engine.loaded} == {"reload_weights"}
            engine_matches(vllm_engine, with_weights(lm, new), 3)
    finally:
        vllm_engine.call(vllm_engine.update_weights(base, 0))


@pytest.mark.slow
def test_moe_policy_on_the_generic_load(vllm_moe_engine, moe_path):
    """The experts' new weights are used (the CPU kernel repacked after ``reload_weights``); they are not read back
    (repacked in place), every other tensor verifies."""
    lm, base = trainer_weights(moe_path)
    new = changed(base, seed=12, scale=0.05)
    try:
        with generic_load(vllm_moe_engine):
            flow = push(vllm_moe_engine, new, 4)  # no WeightMismatch: what is read back matches
            assert not flow.verified  # the experts are not read back
            assert {r["via"] for r in vllm_moe_engine.loaded} == {"reload_weights"}
            engine_matches(vllm_moe_engine, with_weights(lm, new), 4)
    finally:
        vllm_moe_engine.call(vllm_moe_engine.update_weights(base, 0))


@pytest.mark.slow
def test_lora_policy_on_the_generic_load(vllm_lora_engine, lora_lm):
    """A LoRA sync never touches the base weights (an adapter per version, ``lora.AdapterSlots``): the same on every
    platform; checked here with the base weights on the generic path too."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    g = torch.Generator().manual_seed(13)
    state = {k: v + 0.2 * torch.randn(v.shape, generator=g) for k, v in get_peft_model_state_dict(lora_lm).items()}
    with generic_load(vllm_lora_engine):
        flow = push(vllm_lora_engine, state, 5)
        assert flow.verified
        set_peft_model_state_dict(lora_lm, state)
        engine_matches(vllm_lora_engine, lora_lm, 5)
