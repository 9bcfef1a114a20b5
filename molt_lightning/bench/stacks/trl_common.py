"""What the two TRL stacks share: the protocol checks, the ``GRPOConfig`` matched to a protocol, the step log.

``trl`` (``stacks/trl.py``: TRL's own generation, single turn) and ``trl-rollout-func`` (``stacks/trl_rollout_func.py``:
molt's agent program inside TRL's ``rollout_func``) differ only in how completions are made and scored. Both train with
the same ``GRPOConfig`` (below) and log the same way: a callback writes each of TRL's log rows to ``trl_log.jsonl``
with ``bench/step_time_s`` (wall time between optimizer-step ends, as molt's ``RolloutMonitor`` measures it) and
``bench/gen_tokens_per_s`` (TRL's ``completions/mean_length`` x the batch size over that step time: TRL counts a
completion's tokens up to and including its end-of-turn token, and only model tokens where an ``env_mask`` exists,
which is what molt counts). ``importers.STACK_COLUMNS["trl"]`` maps that file, as for TRL logs made elsewhere.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from .support import check_supported, unsupported

SUPPORTED = {"optimizer.name": ("adamw",), "optimizer.schedule": ("constant",), "sampling.top_p": (1.0, 1),
             "algorithm.advantage": ("grpo", "dr_grpo"), "algorithm.loss": ("ppo_clip",),
             "algorithm.updates_per_batch": (1,), "max_lag": (0,)}
# molt's aggregation names -> TRL's loss_type with the same normalisation (one process, no gradient accumulation)
LOSS_TYPE = {"token_mean": "dapo", "seq_mean_token_mean": "grpo", "seq_mean_token_sum_norm": "dr_grpo"}
# protocol algorithm keys these stacks map; any other key is refused rather than silently ignored
MAPPED = {"advantage", "loss", "scale_by_std", "clip_low", "clip_high", "kl_coef", "updates_per_batch",
          "aggregation", "loss_norm_tokens"}
PRECISIONS = ("32-true", "bf16-mixed")  # model.precision (Lightning's names); bf16-mixed -> TRL's bf16=True autocast


def trl_classes(stack: str):
    try:
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        raise ImportError(f"the {stack} stack needs TRL: pip install 'molt-lightning[trl]' (or pip install trl); "
                          f"import failed with: {e}") from e
    return GRPOConfig, GRPOTrainer


def precision(protocol) -> str:
    return str(protocol.data["model"].get("precision", "32-true"))


def check(stack: str, protocol) -> None:
    """Refuse what TRL's GRPOTrainer cannot be set to: each refusal names the field and the values it can take."""
    trl_classes(stack)
    check_supported(stack, protocol, SUPPORTED)
    algo = protocol.data["algorithm"]
    extra = sorted(set(algo) - MAPPED)
    if extra:
        raise unsupported(stack, "algorithm", extra, sorted(MAPPED))
    if algo.get("aggregation", "token_mean") not in LOSS_TYPE:
        raise unsupported(stack, "algorithm.aggregation", algo["aggregation"], sorted(LOSS_TYPE))
    if precision(protocol) not in PRECISIONS:
        raise unsupported(stack, "model.precision", precision(protocol), list(PRECISIONS))
    if protocol.data["model"].get("lora") is not None:  # GRPOConfig trains every weight here: refuse, never ignore
        raise unsupported(stack, "model.lora", protocol.data["model"]["lora"], "[absent] (full fine-tuning)")


def grpo_config(protocol, seed: int, workdir: Path, max_completion_length: int, **extra):
    """``GRPOConfig`` matched to the protocol: one generation per optimizer step, batch = prompts x samples."""
    GRPOConfig, _ = trl_classes("trl")
    p = protocol.data
    opt, algo = p["optimizer"], p["algorithm"]
    P, G = int(p["batch"]["prompts_per_step"]), int(p["batch"]["samples_per_prompt"])
    return GRPOConfig(
        output_dir=str(workdir / "trl"), per_device_train_batch_size=P * G, num_generations=G,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1, max_steps=int(p["steps"]),
        learning_rate=float(opt["lr"]), lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=float(opt["betas"][0]), adam_beta2=float(opt["betas"][1]), weight_decay=float(opt["weight_decay"]),
        max_grad_norm=float(opt["grad_clip"]), optim="adamw_torch", beta=float(algo.get("kl_coef", 0.0)),
        epsilon=float(algo["clip_low"]), epsilon_high=float(algo["clip_high"]),
        loss_type=LOSS_TYPE[algo.get("aggregation", "token_mean")],
        scale_rewards="group" if algo.get("scale_by_std", True) and algo["advantage"] == "grpo" else "none",
        temperature=float(p["sampling"]["temperature"]), top_p=1.0, max_completion_length=max_completion_length,
        use_cpu=True, report_to="none", logging_steps=1, save_strategy="no", seed=seed, data_seed=seed,
        shuffle_dataset=False, bf16=precision(protocol) == "bf16-mixed", fp16=False, disable_tqdm=True,
        log_completions=False, dataloader_num_workers=0,
        model_init_kwargs={"dtype": p["model"].get("dtype", "float32")}, **extra,
    )


def step_log(log_path: Path, samples_per_step: int):
    """A ``TrainerCallback`` writing TRL's log rows plus the bench's step time and generated tokens/s (JSONL)."""
    from transformers import TrainerCallback

    class StepLog(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.last, self.step_time, self.file = time.perf_counter(), None, open(log_path, "w")

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            self.step_time, self.last = now - self.last, now

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "train_runtime" not in logs and self.step_time:
                tokens = float(logs.get("completions/mean_length", float("nan"))) * samples_per_step
                row = {"step": state.global_step, **logs, "bench/step_time_s": self.step_time,
                       "bench/gen_tokens_per_s": tokens / self.step_time}
                self.file.write(json.dumps(row) + "\n")
                self.file.flush()

        def on_train_end(self, args, state, control, **kw):
            self.file.close()

    return StepLog()


def train(trainer, log_path: Path, protocol):
    """Run ``trainer`` (without TRL's per-log printing: the JSONL keeps the rows) and return the normalised frame."""
    from transformers import PrinterCallback

    from .. import importers, runs

    trainer.remove_callback(PrinterCallback)
    trainer.train()
    ((_, raw),) = importers.read_jsonl(log_path)
    spec = importers.STACK_COLUMNS["trl"]
    return runs.normalise(raw, spec["columns"], protocol.samples_per_step, spec["step_base"],
                          per_device=spec["per_device"])
