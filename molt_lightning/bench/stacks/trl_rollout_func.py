"""The trl-rollout-func stack: TRL's ``GRPOTrainer`` trains on the protocol's multi-turn agent through ``rollout_func``.

This is not what a TRL user runs by default (that is the ``trl`` stack, ``stacks/trl.py``: TRL's own single-turn
generation); it is the matched multi-turn comparison: the same agent program, token for token, under TRL's loop.

What is TRL's: the training loop, GRPO advantages, the clipped loss and its aggregation, the optimizer and scheduler
(Hugging Face ``Trainer``), batching of groups, logging. What is matched to the protocol through TRL's own options
(``trl_common.grpo_config``, shared with the ``trl`` stack):
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
measured by a callback as molt's monitor does; tokens/s counts policy-generated tokens only (TRL's completion lengths
count ``env_mask`` 1 tokens), as molt does (``trl_common``).
"""

from __future__ import annotations

import asyncio
import math
import os
from collections import Counter
from pathlib import Path

from . import trl_common
from .molt import dotted

STACK = "trl-rollout-func"


def check(protocol) -> None:
    trl_common.check(STACK, protocol)


def describe(options: dict) -> dict:
    import trl

    return {"trainer": f"trl.GRPOTrainer {trl.__version__}", "generation": "rollout_func + molt TorchEngine",
            "notes": "multi-turn agent through rollout_func; synchronous; group-std eps 1e-4; no TIS; failed agent "
                     "runs score 0 (see stacks/trl_rollout_func.py)"}


class _Rollouts:
    """TRL's ``rollout_func``: the protocol's agent program on molt's client, with TRL's current weights."""

    def __init__(self, protocol, seed: int, model_path: str, tokenizer, samples: list[dict]):
        from ...agents.chat import ChatTemplate
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

    def close(self) -> None:
        self.engine.release()

    async def _one(self, prompt, member: int):
        from ...agents.client import AgentClient
        from ...rollout.agent_run import request_seed
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
                raise RuntimeError(f"the {STACK} stack needs agents whose trajectory is one token sequence starting "
                                   "with the prompt (no history rewrites); this agent produced another shape")
            prompt, *rest = traj.segments[0]
            ids, lps, mask = [], [], []
            for span in rest:
                ids += span.token_ids
                policy = span.kind == Kind.POLICY
                lps += span.logprobs if policy else [0.0] * len(span.token_ids)
                mask += [int(policy)] * len(span.token_ids)
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
    _, GRPOTrainer = trl_common.trl_classes(STACK)
    from datasets import Dataset
    from transformers import AutoTokenizer, set_seed

    from ...trainer.policy import policy_folder

    p = protocol.data
    P, steps = int(p["batch"]["prompts_per_step"]), int(p["steps"])
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
    algo = p["algorithm"]
    config = trl_common.grpo_config(  # dr_grpo's normaliser is max_completion_length
        protocol, seed, workdir, int(algo.get("loss_norm_tokens") or rollouts.max_context), use_vllm=False)
    trainer = GRPOTrainer(model=model_path, reward_funcs=agent_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, rollout_func=rollouts,
                          callbacks=[trl_common.step_log(log_path, protocol.samples_per_step)])
    try:
        return trl_common.train(trainer, log_path, protocol)
    finally:
        rollouts.close()
