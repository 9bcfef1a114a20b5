"""The TRL stack: TRL's ``GRPOTrainer`` trains the protocol's model on the protocol's task, one seed at a time.

What is TRL's: the training loop, GRPO advantages, the clipped loss and its aggregation, the optimizer and scheduler
(Hugging Face ``Trainer``), batching of groups, logging. What is matched to the protocol through TRL's own options:
``per_device_train_batch_size = prompts_per_step x samples_per_prompt``, ``num_generations = samples_per_prompt``,
one optimizer step per generated batch (``steps_per_generation=1``, ``num_iterations=1``, no gradient
accumulation), ``learning_rate``, ``lr_scheduler_type="constant"``, AdamW betas, ``weight_decay``, ``max_grad_norm``,
``beta`` (KL) = ``kl_coef``, ``epsilon``/``epsilon_high`` = ``clip_low``/``clip_high``, ``scale_rewards="group"``
(``"none"`` for Dr. GRPO), ``loss_type`` from molt's ``aggregation`` (``token_mean`` -> ``"dapo"``, a token mean
over the whole batch; ``seq_mean_token_mean`` -> ``"grpo"``; ``seq_mean_token_sum_norm`` -> ``"dr_grpo"``), temperature,
``shuffle_dataset=False`` so prompts arrive in task-stream order, ``seed``.

The multi-turn task is matched, not reduced to single turn: generation goes through TRL's ``rollout_func`` hook (its
documented way to run custom, multi-turn rollouts). The hook runs the protocol's own agent program (the calculator
agent) through molt's ``AgentClient``, so prompts, chat rendering, tool turns and rewards are token for token the
ones molt trains on; tool-reply tokens go back as TRL's ``env_mask`` (0), so TRL's loss skips them as molt's does.
Sampling in the hook uses molt's ``TorchEngine`` (plain transformers forward + multinomial sampling) loaded with
TRL's current weights before every generation, i.e. exactly on-policy, as TRL's own non-vLLM path is.

Differences that remain, and are recorded in the run's notes: TRL has no asynchronous mode on this path, so the run
is synchronous (``max_lag: 0`` in its recorded protocol); TRL's group-std epsilon is 1e-4 (molt 1e-6); TRL applies
no truncated importance sampling without vLLM (on-policy, the engine/trainer ratio is 1 up to float error);
a failed agent run scores 0 and is trained on (molt drops it). Step time is wall time between optimizer-step ends,
measured by a callback as molt's monitor does; tokens/s counts policy-generated tokens only, as molt does.
"""

from __future__ import annotations

import asyncio
from collections import Counter
import json
import math
import os
import time
from pathlib import Path

from . import check_supported, unsupported
from .molt import dotted

SUPPORTED = {"optimizer.name": ("adamw",), "optimizer.schedule": ("constant",), "sampling.top_p": (1.0, 1),
             "algorithm.advantage": ("grpo", "dr_grpo"), "algorithm.loss": ("ppo_clip",),
             "algorithm.updates_per_batch": (1,), "max_lag": (0,)}
# molt's aggregation names -> TRL's loss_type with the same normalisation (one process, no gradient accumulation)
LOSS_TYPE = {"token_mean": "dapo", "seq_mean_token_mean": "grpo", "seq_mean_token_sum_norm": "dr_grpo"}
# protocol algorithm keys this stack maps; any other key is refused rather than silently ignored
MAPPED = {"advantage", "loss", "scale_by_std", "clip_low", "clip_high", "kl_coef", "updates_per_batch",
          "aggregation", "loss_norm_tokens"}


def _trl():
    try:
        import trl  # noqa: F401
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        raise ImportError("the trl stack needs TRL: pip install 'molt-lightning[trl]' (or pip install trl); "
                          f"import failed with: {e}") from e
    return GRPOConfig, GRPOTrainer


def check(protocol) -> None:
    _trl()
    check_supported("trl", protocol, SUPPORTED)
    algo = protocol.data["algorithm"]
    extra = sorted(set(algo) - MAPPED)
    if extra:
        raise unsupported("trl", "algorithm", extra, sorted(MAPPED))
    if algo.get("aggregation", "token_mean") not in LOSS_TYPE:
        raise unsupported("trl", "algorithm.aggregation", algo["aggregation"], sorted(LOSS_TYPE))


def describe(options: dict) -> dict:
    import trl

    return {"trainer": f"trl.GRPOTrainer {trl.__version__}", "generation": "rollout_func + molt TorchEngine",
            "notes": "synchronous; group-std eps 1e-4; no TIS; failed agent runs score 0 (see stacks/trl.py)"}


class _Rollouts:
    """TRL's ``rollout_func``: the protocol's agent program on molt's client, with TRL's current weights."""

    def __init__(self, protocol, seed: int, model_path: str, tokenizer, samples: list[dict]):
        from ...chat import ChatTemplate
        from ...engines import TorchEngine

        self.agent = dotted(protocol.get("task.agent"))
        self.temperature = float(protocol.get("sampling.temperature"))
        self.template = ChatTemplate(tokenizer)
        self.by_question = {s["question"]: s for s in samples}
        self.index_of = {}  # question -> its index in the task stream: molt's sample id, for the request seeds
        for i, s in enumerate(samples):
            self.index_of.setdefault(s["question"], i)
        self.seed = seed
        self.engine = TorchEngine(seed=seed, dtype=protocol.data["model"].get("dtype", "float32"))
        self.engine.launch(model_path)
        self.max_context = self.engine.model.config.max_position_embeddings
        self.tokens = 0  # policy tokens generated since the last read

    def close(self) -> None:
        self.engine.release()

    async def _one(self, prompt, member: int):
        from ...client import AgentClient
        from ...rollout import request_seed
        from ...trajectory import Trajectory

        question = prompt[-1]["content"]
        sample, index = self.by_question[question], self.index_of[question]
        traj = Trajectory(sample_id=index, group_id=0)
        client = AgentClient(self.engine, traj, self.template, self.temperature, self.max_context,
                             seed=request_seed(self.seed, index, member))  # as molt's RolloutSource seeds them
        try:
            result = await self.agent(client, sample)
            reward = float(getattr(result, "reward", result))
        except Exception:  # as molt counts a failed sample; TRL needs a row, so it scores 0
            reward = 0.0
        return traj, reward if math.isfinite(reward) else 0.0

    def __call__(self, prompts: list, trainer) -> dict:
        from ...trajectory import Kind

        model = trainer.accelerator.unwrap_model(trainer.model)
        state = {k: v.detach() for k, v in model.state_dict().items()}
        self.engine.call(self.engine.update_weights(state, trainer.state.global_step))

        members, seen = [], Counter()  # TRL repeats each prompt num_generations times: member j of its group
        for p in prompts:
            members.append(seen[p[-1]["content"]])
            seen[p[-1]["content"]] += 1

        async def _all():
            return await asyncio.gather(*[self._one(p, m) for p, m in zip(prompts, members)])

        out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [], "agent_reward": []}
        for traj, reward in self.engine.call(_all()):
            if len(traj.segments) != 1 or not traj.segments[0] or traj.segments[0][0].kind != Kind.PROMPT:
                raise RuntimeError("the trl stack needs agents whose trajectory is one token sequence starting with "
                                   "the prompt (no history rewrites); this agent produced another shape")
            prompt, *rest = traj.segments[0]
            ids, lps, mask = [], [], []
            for span in rest:
                ids += span.token_ids
                policy = span.kind == Kind.POLICY
                lps += span.logprobs if policy else [0.0] * len(span.token_ids)
                mask += [int(policy)] * len(span.token_ids)
                self.tokens += len(span.token_ids) if policy else 0
            if not ids:  # TRL needs a token per completion: an empty reply is the end-of-turn token, masked out
                ids, lps, mask = [self.template.eos_id], [0.0], [0]
            out["prompt_ids"].append(prompt.token_ids)
            out["completion_ids"].append(ids)
            out["logprobs"].append(lps)
            out["env_mask"].append(mask)
            out["agent_reward"].append(reward)
        return out


def agent_reward(prompts, completions, agent_reward, **kwargs):
    """TRL reward function: the reward the agent program returned (forwarded by ``rollout_func``)."""
    return list(agent_reward)


def run_seed(protocol, seed: int, workdir: Path, options: dict):
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    GRPOConfig, GRPOTrainer = _trl()
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback, set_seed

    from ...policy import policy_folder
    from .. import importers, runs

    p = protocol.data
    P, G, steps = int(p["batch"]["prompts_per_step"]), int(p["batch"]["samples_per_prompt"]), int(p["steps"])
    model_path = policy_folder(p["model"]["policy"])
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"
    stream = dotted(p["task"]["tasks"])(seed)
    samples = [next(stream) for _ in range(P * steps)]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": s["question"]}]} for s in samples])
    set_seed(seed)
    rollouts = _Rollouts(protocol, seed, model_path, tokenizer, samples)
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "trl_log.jsonl"

    class _Log(TrainerCallback):
        """Wall time between step ends (as molt's RolloutMonitor) and generated tokens/s, written with TRL's logs."""

        def on_train_begin(self, args, state, control, **kw):
            self.last, self.step_time, self.file = time.perf_counter(), None, open(log_path, "w")

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            self.step_time, self.last = now - self.last, now
            self.tokens, rollouts.tokens = rollouts.tokens, 0

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "train_runtime" not in logs and self.step_time:
                row = {"step": state.global_step, **logs, "bench/step_time_s": self.step_time,
                       "bench/gen_tokens_per_s": self.tokens / self.step_time}
                self.file.write(json.dumps(row) + "\n")
                self.file.flush()

        def on_train_end(self, args, state, control, **kw):
            self.file.close()

    opt, algo = p["optimizer"], p["algorithm"]
    config = GRPOConfig(
        output_dir=str(workdir / "trl"), per_device_train_batch_size=P * G, num_generations=G,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1, max_steps=steps,
        learning_rate=float(opt["lr"]), lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=float(opt["betas"][0]), adam_beta2=float(opt["betas"][1]), weight_decay=float(opt["weight_decay"]),
        max_grad_norm=float(opt["grad_clip"]), optim="adamw_torch", beta=float(algo.get("kl_coef", 0.0)),
        epsilon=float(algo["clip_low"]), epsilon_high=float(algo["clip_high"]),
        loss_type=LOSS_TYPE[algo.get("aggregation", "token_mean")],
        scale_rewards="group" if algo.get("scale_by_std", True) and algo["advantage"] == "grpo" else "none",
        temperature=float(p["sampling"]["temperature"]), top_p=1.0,
        max_completion_length=int(algo.get("loss_norm_tokens") or rollouts.max_context),  # dr_grpo's normaliser
        use_cpu=True, use_vllm=False, report_to="none", logging_steps=1, save_strategy="no", seed=seed,
        data_seed=seed, shuffle_dataset=False, bf16=False, fp16=False, disable_tqdm=True, log_completions=False,
        dataloader_num_workers=0, model_init_kwargs={"dtype": p["model"].get("dtype", "float32")},
    )
    trainer = GRPOTrainer(model=model_path, reward_funcs=agent_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, rollout_func=rollouts, callbacks=[_Log()])
    trainer.remove_callback(PrinterCallback)  # it prints every log dict; the JSONL log keeps them
    try:
        trainer.train()
    finally:
        rollouts.close()
    ((_, raw),) = importers.read_jsonl(log_path)
    spec = importers.STACK_COLUMNS["trl"]
    return runs.normalise(raw, spec["columns"], protocol.samples_per_step, spec["step_base"],
                          per_device=spec["per_device"])
