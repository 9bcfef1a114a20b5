"""``molt sft``: supervised fine-tuning of a policy folder on conversations, through Lightning.

``molt sft --config recipes/sft_tiny.yaml`` trains ``SFTModule`` (the policy) on ``SFTData`` (the conversations) and
writes the trained policy as a Hugging Face folder (``model.out``) that ``molt fit --model.policy OUT`` starts from.

- **Tokens as RL sees them** (``render``): a conversation is rendered by the policy's own chat template exactly as
  ``AgentClient.chat_turn`` renders a rollout of it, messages first put in the form the run's endpoint hands the
  template (``openai_chat.hf_message``: tool-call arguments as objects). Only the tokens the policy generates (a reply's
  text or tool calls, then end-of-turn) are trained on; prompts, tool results and the template's own text are context.
- **The loss** (``sft_loss``): the token mean of the negative log-likelihood over the assistant tokens of the whole
  batch (under DDP/FSDP2 every rank's: their sum over the ranks' total count), through ``policy.Policy``'s chunked,
  checkpointed head over those tokens only (no (B, T, V) logits).
- **Data** (``SFTData``): JSONL / JSON / Parquet / Arrow files read offline with ``datasets`` (``data.sources``), one
  conversation per row: OpenAI-style messages ``{role, content, tool_calls?}`` in the field ``messages``, optional
  function schemas in ``tools`` (a list or its JSON text); a null counts as absent (Arrow gives every row the union of
  the fields). ``train``/``val`` may also name a function that returns such a file (``models.tiny.demonstrations``).
  Every row is checked and rendered before training: an unreadable file, a missing field, a message without a role,
  no assistant message, more than ``max_tokens`` (or with ``drop_too_long``: dropped, counted, logged) is a
  ``ValueError`` naming the file, the row and the fix.
- **Schedule and logs**: AdamW, linear warm-up over ``warmup`` of the run's steps, cosine decay to 0; gradient clipping
  is the Trainer's ``gradient_clip_val``. Per step ``train/loss``, ``train/tokens`` (assistant tokens of the step, all
  ranks), ``train/lr``; with a ``val`` file ``val/loss`` (token mean over the set). Checkpoints hold the policy under
  ``policy.lm.*`` as ``molt fit``'s do, so ``molt export`` reads them.
- **Strategies**: one process, ``ddp``, ``fsdp2`` (``parallel.shard``; the folder is gathered from the shards).
"""

from __future__ import annotations

import json
import logging
import os
import time
from functools import partial

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from ..config import imported
from ..trainer import lightning_compat, parallel
from ..policies import load_lm
from ..trainer.policy import Policy, policy_folder, trainable_lm
from ..trainer.sft import collate, render, sft_loss, warmup_cosine

lightning_compat.patch()
log = logging.getLogger(__name__)
STRATEGIES = "auto (one process), ddp or fsdp2"


def check_strategy(strategy) -> None:
    spawned = getattr(strategy, "_start_method", "popen") != "popen"  # ddp_spawn & co: the CLI does not pickle
    if type(strategy).__name__ not in ("SingleDeviceStrategy", "DDPStrategy", "FSDP2Strategy") or spawned:
        name = type(strategy).__name__ + (" with spawned processes" if spawned else "")
        raise ValueError(f"--trainer.strategy: {name} is not supported by molt sft: use {STRATEGIES}")


# ----- rendering: a conversation as the tokens of its rollout -----
def conversations(path: str, template, messages: str = "messages", tools: str | None = "tools",
                  max_tokens: int | None = None, drop_too_long: bool = False, limit: int | None = None
                  ) -> list[tuple[list[int], list[int]]]:
    """Every row of ``path`` checked and rendered (see the module docstring): a list of (ids, mask)."""
    from ..data.sources import json_field, read_file, tool_schemas  # the data sources' reader and field checks
    from ..agents.wire.openai_chat import hf_message  # the form the endpoint hands the chat template

    rows = read_file(path, None)[:limit]
    if not rows:
        raise ValueError(f"{path}: no rows")
    out, dropped = [], []
    for i, row in enumerate(rows):
        where = f"{path}, row {i}"
        row = _present(row)
        msgs = json_field(row.get(messages), where, messages)
        if msgs is None:
            raise ValueError(f"{where}: no field {messages!r} (the row has {sorted(row)}): set data.messages to the "
                             "field that holds the conversation")
        if not isinstance(msgs, list) or not msgs:
            raise ValueError(f"{where}: field {messages!r} must be a non-empty list of chat messages "
                             '({"role": "user", "content": "..."}), got ' + type(msgs).__name__)
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
                raise ValueError(f"{where}: message {j} has no role of system, user, assistant or tool ({m!r:.80}): "
                                 "give every message a role and a content")
        if not any(m["role"] == "assistant" for m in msgs):
            raise ValueError(f"{where}: no assistant message, so nothing to learn: add the reply or drop the row")
        schemas = tool_schemas(row.get(tools), where, tools) if tools else None
        try:
            ids, mask = render(template, [hf_message(m, j) for j, m in enumerate(msgs)], schemas)
        except Exception as e:  # the endpoint's check of a message, the template's own errors (Jinja, images)
            raise ValueError(f"{where}: the policy's chat template cannot render it: {type(e).__name__}: {e}") \
                from None
        if max_tokens is not None and len(ids) > max_tokens:
            if not drop_too_long:
                raise ValueError(f"{where}: {len(ids)} tokens, more than data.max_tokens={max_tokens}: shorten or "
                                 "split the conversation, raise data.max_tokens (up to the policy's context), or set "
                                 "data.drop_too_long: true to drop such rows (counted and logged)")
            dropped.append(i)
            continue
        out.append((ids, mask))
    if dropped:
        log.warning("%s: dropped %d of %d conversations longer than %d tokens (rows %s%s)", path, len(dropped),
                    len(rows), max_tokens, dropped[:10], " ..." if len(dropped) > 10 else "")
    if not out:
        raise ValueError(f"{path}: every conversation is longer than data.max_tokens={max_tokens}")
    return out


def _present(x):
    """``x`` without null values (Arrow fills the fields a row lacks with nulls)."""
    if isinstance(x, dict):
        return {k: _present(v) for k, v in x.items() if v is not None}
    return [_present(v) for v in x] if isinstance(x, list) else x


def data_file(spec: str) -> str:
    """A data file: ``spec`` itself, or what the function at the dotted path ``spec`` returns (e.g. a writer)."""
    if os.path.exists(spec) or "/" in spec or spec.endswith((".jsonl", ".json", ".parquet", ".arrow")):
        return spec  # a missing file is named by the reader
    return str(imported(spec, "data file", "no such file, nor the dotted path of a function returning one")())


class SFTData(L.LightningDataModule):
    def __init__(self, train: str, val: str | None = None, policy: str | None = None, messages: str = "messages",
                 tools: str | None = "tools", max_tokens: int | None = None, drop_too_long: bool = False,
                 batch_size: int = 8, shuffle: bool = True, seed: int = 0, limit: int | None = None):
        """
        Args:
            train, val: data files (or dotted paths of functions returning one); ``val`` gives ``val/loss``.
            policy: whose chat template renders the conversations; ``molt sft`` links it to ``model.policy``.
            messages, tools: the fields holding a row's conversation and its tool schemas (``tools``: optional).
            max_tokens: the longest conversation (default: the policy's context); longer ones are an error, or with
                ``drop_too_long`` dropped and counted.
            batch_size: conversations per step and rank; ``shuffle`` with ``seed`` (each epoch another order).
            limit: read only the first rows of each file.
        """
        super().__init__()
        if batch_size < 1 or (max_tokens is not None and max_tokens < 2):
            raise ValueError("data.batch_size must be >= 1 and data.max_tokens >= 2")
        self.save_hyperparameters()
        self.rows: dict[str, list] | None = None
        self.pad_id = 0
        if not val:
            self.val_dataloader = None  # no validation loop (Lightning skips a hook that is None)

    def load(self) -> None:
        """Read, check and render the files (once): the errors come here, before training."""
        if self.rows is not None:
            return
        from transformers import AutoConfig, AutoTokenizer

        from ..agents.chat import ChatTemplate

        h = self.hparams
        folder = policy_folder(h.policy or self.trainer.lightning_module.hparams.policy)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        template = ChatTemplate(tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else template.eos_id
        context = AutoConfig.from_pretrained(folder).get_text_config().max_position_embeddings
        kw = dict(messages=h.messages, tools=h.tools, max_tokens=h.max_tokens or context,
                  drop_too_long=h.drop_too_long, limit=h.limit)
        self.rows = {split: conversations(data_file(path), template, **kw)
                     for split, path in (("train", h.train), ("val", h.val)) if path}

    def setup(self, stage: str) -> None:
        self.load()

    def _loader(self, split: str, shuffle: bool):
        generator = torch.Generator().manual_seed(self.hparams.seed)
        return torch.utils.data.DataLoader(self.rows[split], batch_size=self.hparams.batch_size, shuffle=shuffle,
                                           generator=generator, collate_fn=partial(collate, pad_id=self.pad_id))

    def train_dataloader(self):
        return self._loader("train", self.hparams.shuffle)

    def val_dataloader(self):
        return self._loader("val", False)


# ----- the module -----
class SFTModule(L.LightningModule):
    def __init__(self, policy: str = "molt_lightning.models.tiny.base_policy", out: str | None = None,
                 lr: float = 1e-4, weight_decay: float = 0.0, warmup: float = 0.1, dtype: str = "float32",
                 logit_chunk_tokens: int = 512, activation_checkpointing: bool = False,
                 torch_threads: int | None = None):
        """
        Args:
            policy: a Hugging Face model folder, or the dotted path of a function that returns one.
            out: write the trained policy there as a Hugging Face folder when training ends (rank 0).
            lr, weight_decay: AdamW's; the rate warms up linearly over ``warmup`` (a fraction of the run's steps),
                then decays to 0 on a cosine.
            dtype: the parameters' dtype; logit_chunk_tokens: rows of the output head at a time.
            torch_threads: intra-op threads (``torch.set_num_threads``); None leaves torch's default.
        """
        super().__init__()
        if lr <= 0 or weight_decay < 0 or not 0 <= warmup < 1 or logit_chunk_tokens < 1 \
                or not getattr(getattr(torch, dtype, None), "is_floating_point", False):
            raise ValueError("model.lr must be > 0, model.weight_decay >= 0, model.warmup in [0, 1) (a fraction of the "
                             "run's steps), model.logit_chunk_tokens >= 1, model.dtype float32, bfloat16 or float16")
        self.save_hyperparameters()
        self.policy: Policy | None = None
        self.policy_path: str | None = None
        self._val = torch.zeros(2, dtype=torch.float64)  # validation: summed NLL, tokens
        self._t0 = time.perf_counter()

    def setup(self, stage: str) -> None:
        check_strategy(self.trainer.strategy)

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        h = self.hparams
        if h.torch_threads:
            torch.set_num_threads(h.torch_threads)
        self.policy_path = policy_folder(h.policy)
        lm, _ = trainable_lm(self.policy_path, getattr(torch, h.dtype), h.activation_checkpointing)
        self.policy = Policy(lm, chunk_tokens=h.logit_chunk_tokens, share_prefix=False)
        parallel.shard(self.policy, self.trainer.strategy)

    def configure_optimizers(self):
        h = self.hparams
        opt = torch.optim.AdamW(self.policy.parameters(), lr=h.lr, weight_decay=h.weight_decay)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = max(1, round(h.warmup * total)) if h.warmup else 0
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, partial(warmup_cosine, total=total, warmup=warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def _nll(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed negative log-likelihood of the batch's assistant tokens and their count, on this rank."""
        ids, labels, attention = batch
        logprobs = self.policy(ids, attention, labels != -100, 1.0)[0]  # (B, T-1)
        return sft_loss(logprobs, labels, torch.ones((), device=ids.device)), (labels[:, 1:] != -100).sum()

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        nll, tokens = self._nll(batch)
        total = self.trainer.strategy.reduce(tokens.clone(), reduce_op="sum")  # every rank's assistant tokens
        loss = nll * self.trainer.world_size / total.clamp(min=1)  # DDP/FSDP2 average over ranks: the token mean
        self.log("train/loss", loss.detach(), prog_bar=True, sync_dist=True, batch_size=1)
        self.log("train/tokens", total.float(), batch_size=1)
        self.log("train/lr", self.optimizers().param_groups[0]["lr"], batch_size=1)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        nll, tokens = self._nll(batch)
        self._val += torch.stack([nll.detach().double().cpu(), tokens.double().cpu()])

    def on_validation_epoch_end(self) -> None:
        total = self.trainer.strategy.reduce(self._val.to(self.device, copy=True), reduce_op="sum")  # (in place)
        self._val.zero_()
        if total[1] > 0:
            self.log("val/loss", float(total[0] / total[1]), batch_size=1)

    def on_train_start(self) -> None:
        self._t0 = time.perf_counter()  # molt_sft.json's "seconds": training alone

    def on_train_end(self) -> None:
        if self.hparams.out:
            self.write(self.hparams.out)

    def write(self, out: str) -> None:
        """The policy as a Hugging Face folder ``out`` (rank 0 writes; under FSDP2 every rank helps gather it)."""
        from .export import load_exactly, save_folder
        from ..trainer.weights import buckets

        lm, sharded = self.policy.lm, parallel.is_sharded(self.trainer.strategy)
        if sharded:  # every rank takes part in each all-gather, as in a weight sync
            state = {n: t.cpu() for bucket in buckets(lm, 2**30) for n, t in bucket.items()}
        if self.global_rank == 0:
            if sharded:
                lm = load_lm(self.policy_path, getattr(torch, self.hparams.dtype))
                load_exactly(lm, state, "the gathered shards")
            metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items()
                       if k.startswith(("train/", "val/"))}
            folder = save_folder(lm, self.policy_path, out)
            (folder / "molt_sft.json").write_text(json.dumps({
                "base_policy": self.policy_path, "global_step": self.global_step, "metrics": metrics,
                "seconds": round(time.perf_counter() - self._t0, 1)}, indent=1) + "\n")
            rank_zero_info(f"molt sft: wrote the trained policy to {out}")
        self.trainer.strategy.barrier()


# ----- molt sft -----
def main(argv: list[str], parser_class) -> None:
    """Fits with ``molt fit``'s terminal: a step bar and a summary (the loss at the start and the end: sft measures
    no skill), on a terminal (``wants_quiet``) everything else in ``molt.log`` in the run folder; then where the
    policy went."""
    from ..callbacks.runlog import quieted, run_folder

    quiet: list = []
    with quieted(quiet):
        cli = sft_cli(argv, parser_class, quiet)
        if quiet:
            quiet[0].move_to(run_folder(cli.trainer) / "molt.log")
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    out = cli.model.hparams.out
    if out and cli.trainer.global_rank == 0:
        print(f"  trained policy: {out} (a model.policy: molt fit --config RECIPE --model.policy {out})", flush=True)


def sft_cli(argv: list[str], parser_class, quiet: list | None = None):
    """``molt sft --config RECIPE [--trainer.KEY VALUE] [--model.KEY VALUE] [--data.KEY VALUE]``: LightningCLI over
    ``SFTModule`` and ``SFTData`` (``data.policy`` follows ``model.policy``) with ``molt``'s parser (``parser_class``:
    ``cli.MoltParser``). The data is read, checked and rendered before the Trainer starts; a bad recipe or row is
    answered with the fix, without a traceback. Given a list, ``quiet`` gets a quiet terminal (``wants_quiet``)."""
    import warnings

    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from lightning.pytorch.cli import LightningCLI

    from ..callbacks.runlog import QuietTerminal, RunSummary, terminal_callbacks, unlogged_root, wants_quiet

    class SFTCLI(LightningCLI):
        def add_arguments_to_parser(self, parser) -> None:
            parser.link_arguments("model.policy", "data.policy")

        def instantiate_classes(self) -> None:
            try:
                if quiet is not None and wants_quiet():
                    quiet.append(QuietTerminal())
                super().instantiate_classes()
                check_strategy(self.trainer.strategy)  # answered here, not as a traceback once fit starts
                self.datamodule.load()
            except (ValueError, MisconfigurationException) as e:
                self.parser.error(str(e), e)

        def instantiate_trainer(self, **kwargs):
            trainer = self._get(self.config_init, "trainer", default={})
            terminal = quiet[0].terminal if quiet else None
            kwargs["callbacks"] = terminal_callbacks(list(trainer.get("callbacks") or []),
                                                     trainer.get("enable_progress_bar") is not False, terminal,
                                                     RunSummary(out=terminal, metric="train/loss", digits=".3g"))
            kwargs.update(unlogged_root(trainer))
            return super().instantiate_trainer(**kwargs)

    # "args and sys.argv both given": `sft` is molt's word, not LightningCLI's
    with warnings.catch_warnings(action="ignore", category=UserWarning):
        return SFTCLI(SFTModule, SFTData, run=False, args=argv, parser_class=parser_class,
                      parser_kwargs={"prog": "molt sft"}, save_config_kwargs={"overwrite": True},
                      auto_configure_optimizers=False)
