"""The tinker-cookbook stack: tinker-cookbook's RL trainer, unchanged, training through ``molt tinker``.

Per seed: start ``molt tinker --policy FOLDER`` (molt's server for the Tinker API) as a subprocess, wait for the two
``export TINKER_...`` lines it prints when ready, run ``tinker_cookbook.rl.train.main(Config)`` against it (the
cookbook's own sampling, advantages, data assembly, loss call and optimizer step; the server does the forward,
backward, Adam step and sampling), read the cookbook's ``metrics.jsonl`` and stop the server. The environment is the
protocol's single-turn task written against the cookbook's interface (``stacks/tinker_env.py``): the same prompts for
the same seed as molt draws, scored by the protocol's ``task.reward``, nothing added.

What the cookbook is told, from the protocol: ``model_name`` = the policy's folder (absolute), the renderer
(``qwen3_instruct`` by default: it renders molt's tiny ChatML token for token, checked per seed), ``group_size`` =
``batch.samples_per_prompt``, groups per batch = ``batch.prompts_per_step``, ``max_tokens`` =
``sampling.max_tokens_per_turn``, ``temperature``, ``learning_rate`` = ``optimizer.lr``, ``lora_rank`` =
``model.lora.r``, ``max_steps`` = ``steps``, and ``loss_fn="ppo"`` with the ratio bounds ``[1 - clip_low, 1 +
clip_high]`` for ``algorithm.loss: ppo_clip`` (``importance_sampling``, the cookbook's default, is the same objective
while the ratio is 1; ppo keeps the protocol's clip). ``save_every=0`` and ``eval_every=0`` (no checkpoint or
evaluation inside a timed step; the cookbook still saves ``final`` after the last step) and ``num_groups_to_log=0``
(no transcripts printed or written per step; its metric tables go to the log at INFO, which this stack turns down to
WARNING as the molt stack does Lightning's).

What the cookbook fixes, recorded in the run's protocol as this stack's changes (``STACKS["tinker-cookbook"]``):
- ``max_lag: 0``: ``rl.train``'s default loop is synchronous (one sampler per step, from the newest weights).
- ``optimizer.betas: [0.9, 0.95]``: ``rl.train.train_step`` sends ``AdamParams(lr, 0.9, 0.95, eps=1e-8)`` (molt's
  AdamW: 0.9, 0.999, eps 1e-8); ``optimizer.weight_decay: 0`` and ``optimizer.grad_clip: 0``: it sends neither.
- ``algorithm.scale_by_std: false``: ``rl.data_processing.compute_advantages`` is reward minus the group's mean.
- ``algorithm.aggregation: seq_mean_token_sum``: the Tinker losses sum over every token of every datum; molt's
  ``seq_mean_token_sum`` divides that sum by the batch's rows, a constant (every reply has a token), so under Adam
  the step is the same up to eps.
Checked, not changed: ``model.lora`` is what the server trained (rank, alpha 32, the layers it adapts for the
cookbook's ``lora_config``: attention, MLP, unembedding), read back from the peft config ``molt tinker`` saves with the
``final`` checkpoint (``check_adapter``). Not in any protocol field, so only said here: PPO's "old" logprobs are the
sampler's (molt's ``ppo_clip`` takes the trainer's before the update and truncates the engine ratio at ``tis_cap``:
equal at max_lag 0 up to sampler/trainer numerics); the sampling seeds and the adapter's initialisation are the
server's (seeds differ in their prompts, not in the server's random streams); ``tokens_per_s_per_device`` is this
stack's ``bench/gen_tokens_per_s``: the cookbook's ``env/all/total_ac_tokens`` (every sampled token, the end-of-turn
one included, as molt counts) over ``time/total`` (the step's wall time: sampling, train step, the next sampler).

Single turn only, as the ``trl`` stack: a protocol whose agent takes several turns is refused (run its single-turn
variant). ``model.lora`` is required: the Tinker API trains LoRA adapters only (``arithmetic-single-turn-lora`` is
``arithmetic-single-turn`` so). The server samples with molt's ``TorchEngine``; ``--engine vllm`` is refused.
Options for ``runner.run``: ``renderer`` (a cookbook renderer name), ``ready_timeout_s`` (how long the server may
take to print its ready lines; default 600).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from .support import check_supported, unsupported

STACK = "tinker-cookbook"
RENDERER = "qwen3_instruct"
LORA_ALPHA = 32  # the cookbook's hyperparam_utils assumes alpha 32; the Tinker API does not carry it
SUPPORTED = {"optimizer.name": ("adamw",), "optimizer.schedule": ("constant",), "sampling.top_p": (1.0, 1),
             "algorithm.advantage": ("grpo", "dr_grpo"), "algorithm.loss": ("ppo_clip",),
             "algorithm.updates_per_batch": (1,), "algorithm.kl_coef": (0, 0.0), "max_lag": (0,),
             "optimizer.betas": ([0.9, 0.95],), "optimizer.grad_clip": (0, 0.0), "optimizer.weight_decay": (0, 0.0),
             "algorithm.scale_by_std": (False,), "algorithm.aggregation": ("seq_mean_token_sum",)}
MAPPED = {"advantage", "loss", "scale_by_std", "clip_low", "clip_high", "kl_coef", "updates_per_batch", "aggregation"}


def cookbook(stack: str = STACK):
    from ...extras import require

    require("tinker", f"the {stack} stack")  # MissingExtra, naming make extra-tinker
    from tinker_cookbook.rl import train

    return train


def check(protocol) -> None:
    cookbook()
    p = protocol.data
    turns = p["task"].get("max_turns")
    if turns != 1:
        raise ValueError(f"stack {STACK} runs tinker-cookbook's single-turn environment, and this protocol's agent "
                         f"takes task.max_turns={turns!r}: run the protocol's single-turn variant (e.g. "
                         "arithmetic-single-turn-lora for arithmetic-tiny) on both stacks")
    if not p["task"].get("reward"):
        raise ValueError(f"stack {STACK} scores replies with task.reward (a TRL-style reward(prompts, completions, "
                         "**sample_fields) that scores as task.agent does, e.g. "
                         "molt_lightning.tasks.arithmetic.tool_call_reward); add it to the protocol")
    check_supported(STACK, protocol, SUPPORTED)
    if str(p["model"].get("precision", "32-true")) != "32-true":
        raise unsupported(STACK, "model.precision", p["model"]["precision"], ["32-true"])
    extra = sorted(set(p["algorithm"]) - MAPPED)
    if extra:
        raise unsupported(STACK, "algorithm", extra, sorted(MAPPED))
    lora = p["model"].get("lora")
    if not isinstance(lora, dict):
        raise ValueError(f"stack {STACK} trains a LoRA adapter (the Tinker API trains nothing else) and this "
                         "protocol has no model.lora: run arithmetic-single-turn-lora, or add e.g. --set "
                         f"'model.lora={{r: 32, alpha: {LORA_ALPHA}}}' and run molt's side with the same")
    if float(lora.get("alpha", LORA_ALPHA)) != LORA_ALPHA:
        raise unsupported(STACK, "model.lora.alpha", lora.get("alpha"), [LORA_ALPHA])
    if float(lora.get("dropout", 0.0)) != 0.0:
        raise unsupported(STACK, "model.lora.dropout", lora.get("dropout"), [0.0])


def describe(options: dict) -> dict:
    import tinker
    import tinker_cookbook

    return {"trainer": f"tinker_cookbook.rl.train.main {tinker_cookbook.__version__} (tinker SDK {tinker.__version__})",
            "server": "molt tinker (subprocess, loopback)", "renderer": options.get("renderer") or RENDERER,
            "notes": "synchronous; Adam betas (0.9, 0.95), no clipping; advantages centred, not scaled; loss summed; "
                     "LoRA alpha 32; sampling seeded by the server (see stacks/tinker_cookbook.py)"}


def server_command(policy: str, api_key: str, state_dir: Path) -> list[str]:
    return [sys.executable, "-m", "molt_lightning.commands.cli", "tinker", "--policy", policy, "--host", "127.0.0.1",
            "--port", "0", "--api-key", api_key, "--state-dir", str(state_dir)]


class Server:
    """``molt tinker`` as a subprocess: ``start`` returns once it has printed its ``export TINKER_BASE_URL=`` and
    ``export TINKER_API_KEY=`` lines (or raises, with its log, if it exits or the deadline passes first)."""

    def __init__(self, command: list[str], log_path: Path, env: dict | None):
        self.command, self.log_path, self.env = command, log_path, env
        self.exports: dict[str, str] = {}
        self.ready = threading.Event()  # set by the reader: both lines seen, or the server's output ended
        self.ended = threading.Event()  # the server's output ended: it exited
        self.on_end = None  # called from the reader thread when the output ends (``watch``)

    def start(self, timeout_s: float) -> tuple[str, str]:
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=self.env, bufsize=1)
        self.reader = threading.Thread(target=self._read, name="molt-tinker-output", daemon=True)
        self.reader.start()
        self.ready.wait(timeout_s)
        if {"TINKER_BASE_URL", "TINKER_API_KEY"} <= set(self.exports):
            return self.exports["TINKER_BASE_URL"], self.exports["TINKER_API_KEY"]
        ended = self.ended.is_set()  # its output ended: it exited, or is about to
        self.stop()
        why = f"exited with status {self.proc.returncode}" if ended else f"printed no ready lines in {timeout_s:.0f} s"
        raise RuntimeError(f"molt tinker {why} ({' '.join(self.command)}); its output ({self.log_path}):\n"
                           f"{self.tail()}")

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.write(line)
            self.log.flush()
            key, sep, value = line.strip().removeprefix("export ").partition("=")
            if sep and key in ("TINKER_BASE_URL", "TINKER_API_KEY"):
                self.exports[key] = value.strip().strip("'\"")
                if len(self.exports) == 2:
                    self.ready.set()
        self.ended.set()
        self.ready.set()
        if self.on_end is not None:
            self.on_end()

    def tail(self, lines: int = 20) -> str:
        return "".join(Path(self.log_path).read_text().splitlines(keepends=True)[-lines:])

    async def watch(self, coro):
        """Await ``coro`` (the cookbook's training) unless the server exits first: then cancel it and raise with
        the server's output, instead of letting the SDK retry a dead address for minutes."""
        import asyncio

        loop = asyncio.get_running_loop()
        ended = loop.create_future()

        def end() -> None:
            try:
                loop.call_soon_threadsafe(lambda: ended.done() or ended.set_result(None))
            except RuntimeError:  # the loop has closed: the training ended first
                pass

        self.on_end = end
        if self.ended.is_set():
            end()
        task = asyncio.ensure_future(coro)
        try:
            await asyncio.wait({task, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.on_end = None
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise RuntimeError(f"molt tinker exited with status {self.proc.wait()} during training; its output "
                               f"({self.log_path}):\n{self.tail()}")
        return task.result()

    def stop(self) -> None:
        if self.ended.is_set():  # its output ended: let it finish exiting, so that its own status is recorded
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.reader.join(timeout=10)
        self.log.close()


def check_renderer(renderer, tokenizer, question: str) -> None:
    """The cookbook's prompt must be the tokens molt sends: the policy's own chat template, one user message."""
    messages = [{"role": "user", "content": question}]
    cookbook_ids = renderer.build_generation_prompt(messages).to_ints()
    molt_ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"])
    if cookbook_ids != molt_ids:
        raise ValueError(f"the cookbook's renderer does not render this policy's chat template: {cookbook_ids} "
                         f"against {molt_ids} for {question!r}; pick the renderer that does (option renderer)")


def check_adapter(protocol, state_dir: Path) -> None:
    """The adapter ``molt tinker`` trained must be the protocol's ``model.lora`` (rank, alpha, target layers), read
    from the peft config it saved with the cookbook's ``final`` checkpoint: else molt's side of a comparison trained
    another adapter. (The server picks the layers from the cookbook's ``lora_config``: attention, MLP, unembedding.)"""
    import json

    saved = sorted(Path(state_dir).rglob("adapter_config.json"))
    if not saved:
        raise RuntimeError(f"no adapter_config.json under {state_dir}: cannot check that molt tinker trained the "
                           "protocol's model.lora")
    lora = protocol.data["model"]["lora"]
    want = (int(lora["r"]), float(lora.get("alpha", LORA_ALPHA)), sorted(lora.get("target_modules") or []))
    for path in saved:
        c = json.loads(path.read_text())
        got = (int(c["r"]), float(c["lora_alpha"]), sorted(c["target_modules"]))
        if got != want:
            raise ValueError(f"molt tinker trained rank {got[0]}, alpha {got[1]:g} on {got[2]} ({path}), and the "
                             f"protocol's model.lora says rank {want[0]}, alpha {want[1]:g} on {want[2]}: make "
                             "model.lora what the server trains, so that molt's side trains the same adapter")


def config(protocol, seed: int, log_path: Path, policy: str, base_url: str, renderer: str):
    from .tinker_env import TaskStreamBuilder

    train = cookbook()
    p = protocol.data
    algo, steps = p["algorithm"], int(p["steps"])
    dataset = TaskStreamBuilder(
        tasks=p["task"]["tasks"], reward=p["task"]["reward"], seed=seed, batch_size=int(p["batch"]["prompts_per_step"]),
        group_size=int(p["batch"]["samples_per_prompt"]), steps=steps, model_name=policy, renderer_name=renderer)
    return train.Config(
        learning_rate=float(p["optimizer"]["lr"]), dataset_builder=dataset, model_name=policy,
        recipe_name="molt_bench", max_tokens=int(p["sampling"]["max_tokens_per_turn"]), log_path=str(log_path),
        eval_every=0, save_every=0, renderer_name=renderer, lora_rank=int(p["model"]["lora"]["r"]),
        temperature=float(p["sampling"]["temperature"]), base_url=base_url, max_steps=steps, num_groups_to_log=0,
        loss_fn="ppo",
        loss_fn_config={"clip_low_threshold": 1.0 - float(algo["clip_low"]),
                        "clip_high_threshold": 1.0 + float(algo["clip_high"])})


def run_seed(protocol, seed: int, workdir: Path, options: dict):
    import asyncio

    from tinker_cookbook import renderers
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    from ...trainer.policy import policy_folder
    from .. import importers, runs
    from .tinker_env import dotted

    if options.get("engine", "torch") != "torch":
        raise ValueError(f"--engine {options['engine']!r}: the {STACK} stack samples on molt tinker's own engines "
                         "(TorchEngine); leave --engine out")
    train = cookbook()
    logging.getLogger("tinker_cookbook").setLevel(logging.WARNING)
    p = protocol.data
    policy = os.path.abspath(policy_folder(p["model"]["policy"]))
    renderer = options.get("renderer") or RENDERER
    first = next(dotted(p["task"]["tasks"])(seed))
    tokenizer = get_tokenizer(policy)
    check_renderer(renderers.get_renderer(renderer, tokenizer), tokenizer, first["question"])
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "cookbook"
    shutil.rmtree(log_path, ignore_errors=True)  # a failed attempt's checkpoints would make the cookbook resume
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    key = f"tml-{secrets.token_urlsafe(24)}"
    server = Server(server_command(policy, key, workdir / "server_state"), workdir / "server.log", env)
    base_url, key = server.start(float(options.get("ready_timeout_s") or 600))
    saved = {k: os.environ.get(k) for k in ("TINKER_API_KEY", "HF_HUB_OFFLINE")}
    os.environ.update(TINKER_API_KEY=key, HF_HUB_OFFLINE="1")
    try:
        asyncio.run(server.watch(train.main(config(protocol, seed, log_path, policy, base_url, renderer))))
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    check_adapter(protocol, workdir / "server_state")
    ((_, raw),) = importers.read_jsonl(log_path / "metrics.jsonl")
    spec = importers.STACK_COLUMNS[STACK]
    raw = importers.step_rows(raw, spec).copy()
    raw["bench/gen_tokens_per_s"] = raw["env/all/total_ac_tokens"] / raw["time/total"]
    columns = {**spec["columns"], "tokens_per_s_per_device": "bench/gen_tokens_per_s"}
    return runs.normalise(raw, columns, protocol.samples_per_step, spec["step_base"],
                          per_device=("tokens_per_s_per_device",))
