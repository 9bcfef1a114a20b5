"""How one rollout batch is cut for training: ranks, mini-batches (one optimizer step each), micro-batches.

``plan(batch, world, rank, mini_batches, micro_batch_tokens)`` is a pure function of the batch, so every rank computes
the same plan for all ranks without talking to the others:
- **ranks** get whole groups (no prompt is trained by two ranks within a step), balanced by token count;
- each rank's rows are split into ``mini_batches`` contiguous parts, part j of every rank forming mini-batch j;
- each part is packed into micro-batches of at most ``micro_batch_tokens`` padded tokens (rows x their longest
  length; rows sorted by length so padding stays small); every rank runs the same number of micro-batches per
  mini-batch (the collectives of DDP and FSDP2 must line up), a rank with fewer runs empty ones (``rows`` empty);
- ``Norm`` holds the mini-batch-wide counts (over all ranks and micro-batches) that every aggregation divides by, so
  the accumulated gradient equals the gradient of the whole mini-batch at once, in every aggregation mode;
- ``StepMetrics`` puts the parts' metrics back together into one value per step;
- ``constants`` computes, in one no-grad pass over this rank's micro-batches, the per-token values an update needs
  before its first optimizer step (PPO's old logprobs, the reference's logprobs, the value head's predictions, the
  entropies a token selection reads); ``policy_forward`` is the same pass for the policy alone, for callbacks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import parallel
from ..algorithms import SelectionInputs
from ..algorithms.objective import ADDITIVE_METRICS, Norm
from ..trajectory import Batch


@dataclass
class MiniBatch:
    micro: list[list[int]]  # this rank's rows per micro-batch (batch row indices); the same count on every rank
    norm: Norm


def rank_rows(batch: Batch, world: int) -> list[list[int]]:
    """Batch rows per rank: whole groups, each to the rank with the fewest tokens so far (largest groups first)."""
    lengths = batch.attention_mask.sum(-1).tolist()
    groups: dict[int, list[int]] = {}
    for row, g in enumerate(batch.group_ids.tolist()):
        groups.setdefault(g, []).append(row)
    if len(groups) < world:
        raise ValueError(f"a batch of {len(groups)} groups cannot give each of {world} ranks a whole group: "
                         f"raise prompts_per_step to at least {world} (or use fewer devices)")
    load, out = [0] * world, [[] for _ in range(world)]
    for rows in sorted(groups.values(), key=lambda rows: -sum(lengths[r] for r in rows)):
        r = min(range(world), key=lambda i: (load[i], i))
        out[r] += rows
        load[r] += sum(lengths[i] for i in rows)
    return [sorted(rows) for rows in out]


def pack(rows: list[int], lengths: list[int], budget: int | None) -> list[list[int]]:
    """Rows into micro-batches of at most ``budget`` padded tokens (all in one without a budget)."""
    if not budget:
        return [rows]
    too_long = [lengths[r] for r in rows if lengths[r] > budget]
    if too_long:
        raise ValueError(f"micro_batch_tokens={budget} is smaller than one sequence ({max(too_long)} tokens): raise "
                         f"it to at least {max(too_long)} (or shorten the agent's context)")
    micro, cur = [], []
    for r in sorted(rows, key=lambda r: -lengths[r]):
        if cur and (len(cur) + 1) * lengths[cur[0]] > budget:
            micro.append(cur)
            cur = []
        cur.append(r)
    return micro + [cur] if cur else micro


def plan(batch: Batch, world: int, rank: int, mini_batches: int = 1,
         micro_batch_tokens: int | None = None) -> list[MiniBatch]:
    """This rank's mini-batches, each a list of micro-batches (row indices) and the mini-batch-wide ``Norm``."""
    lengths = batch.attention_mask.sum(-1).tolist()
    mask = batch.loss_mask
    per_rank = rank_rows(batch, world)
    if min(len(rows) for rows in per_rank) < mini_batches:
        raise ValueError(f"mini_batches={mini_batches} needs at least that many rows on every rank, but a rank holds "
                         f"{min(len(r) for r in per_rank)}: lower mini_batches or raise prompts_per_step/group_size")
    parts = [[rows[i * len(rows) // mini_batches:(i + 1) * len(rows) // mini_batches] for i in range(mini_batches)]
             for rows in per_rank]  # parts[rank][j]
    out = []
    for j in range(mini_batches):
        packed = [pack(parts[r][j], lengths, micro_batch_tokens) for r in range(world)]
        n_micro = max(len(p) for p in packed)
        rows_j = [row for r in range(world) for row in parts[r][j]]
        out.append(MiniBatch(packed[rank] + [[]] * (n_micro - len(packed[rank])), Norm.of(mask[rows_j])))
    return out


def selected(batch: Batch, select, entropy: torch.Tensor | None, cfg) -> tuple[Batch, dict[str, float]]:
    """``batch`` with its loss mask after the recipe's token selection (``algorithms.selection``: it sees every row of
    every rank, so the plan's norms then count only the tokens kept), and what it kept: ``select/kept_frac`` (of the
    policy tokens), ``select/samples_dropped`` (rows of samples that kept no token)."""
    mask = batch.loss_mask[:, 1:]  # (N, T-1)
    causes = [getattr(batch.trajectories[i].truncation, "value", "") for i in batch.traj_ids.tolist()]  # (N,)
    kept = select(SelectionInputs(mask, entropy, causes), cfg) & mask  # a selection only removes tokens
    dropped = int((mask.any(-1) & ~kept.any(-1)).sum())  # rows that had a policy token and kept none
    metrics = {"select/kept_frac": float(kept.sum()) / max(float(mask.sum()), 1.0), "select/samples_dropped": dropped}
    return replace(batch, loss_mask=torch.cat([batch.loss_mask[:, :1], kept], 1)), metrics


def batch_metrics(batch: Batch, minis: list, shaped: torch.Tensor, steps: int, version: int
                  ) -> tuple[dict[str, float], torch.Tensor, int]:
    """The batch's own step metrics (rewards, lag, sizes, padding), its tokens' mean lag behind ``version`` (the
    trainer's, before the step) and its sample count."""
    mask, rewards = batch.loss_mask[:, 1:], batch.outcomes.rewards  # (N, T-1), (M,)
    lag = (version - batch.versions[:, 1:][mask]).float()  # (tokens,); none when a selection left no token
    none = torch.tensor(0.0)
    return {"reward/shaped": shaped.mean(), "reward/std": rewards.std() if rewards.numel() > 1 else none,
            "lag/max": lag.max() if lag.numel() else none, "batch/samples": float(rewards.numel()),
            "batch/policy_tokens": mask.sum().float(), "batch/optimizer_steps": float(steps),
            "batch/padding_frac": padding_frac(batch, minis)}, lag.mean() if lag.numel() else none, rewards.numel()


def padding_frac(batch: Batch, minis: list[MiniBatch]) -> float:
    """The share of pad tokens in this rank's micro-batches (what sequence packing could save)."""
    lengths = batch.attention_mask.sum(-1).tolist()
    micro = [rows for mb in minis for rows in mb.micro if rows]
    padded = sum(len(rows) * max(lengths[r] for r in rows) for rows in micro)
    return 1.0 - sum(lengths[r] for rows in micro for r in rows) / max(padded, 1)


def rows_of(batch: Batch, rows: list[int]) -> Batch:
    """The sub-batch of ``rows``, cut to its longest row (less padding), with those rows' images (a VLM's); the
    trajectories stay the batch's."""
    idx = torch.tensor(rows, dtype=torch.long, device=batch.input_ids.device)
    width = int(batch.attention_mask[idx].sum(-1).max())
    cut = {k: v[idx][:, :width] if v.dim() >= 2 else v[idx]  # per-token fields: (N, T, ...)
           for k, v in vars(batch).items() if isinstance(v, torch.Tensor)}
    images = None if batch.images is None else batch.images.select(rows)  # the rows' images, in their order
    return Batch(**{**vars(batch), **cut, "images": images})


def any_row(mb: MiniBatch) -> list[int]:
    """A row of ``mb`` on this rank: an empty micro-batch runs it with weight 0 (the ranks' collectives line up)."""
    return [next(r for rows in mb.micro for r in rows)]


@dataclass
class Constants:
    """Per-token constants of one update, (N, T-1) on this rank's rows, or None when not needed."""

    old: torch.Tensor | None = None  # the policy before the batch's first update: PPO's old logprobs
    ref: torch.Tensor | None = None  # the frozen reference's logprobs
    values: torch.Tensor | None = None  # the value head's predictions, every rank's rows
    teacher: torch.Tensor | None = None  # the distillation teacher's logprobs
    entropy: torch.Tensor | None = None  # the policy's entropies before the update, every rank's rows (selections)

    def rows(self, idx: torch.Tensor, cut: int) -> Constants:
        """The constants of rows ``idx``, cut to ``cut`` positions."""
        return Constants(*(None if t is None else t[idx, :cut] for t in vars(self).values()))


def micro_batches(batch: Batch, minis: list[MiniBatch]):
    """(rows, sub-batch) of each of this rank's micro-batches, in the step's order; an empty one (another rank has
    more) comes as ``([], a real row's sub-batch)``: run it, store nothing (the ranks' collectives line up)."""
    for mb in minis:
        for rows in mb.micro:
            yield rows, rows_of(batch, rows or any_row(mb))


@torch.no_grad()
def policy_forward(policy, batch: Batch, minis: list[MiniBatch], temperature: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's logprobs and entropies of the sampled tokens (N, T-1 each, on this rank's rows, 0 elsewhere and
    off the loss mask), computed as the step computes them: its micro-batches, at the sampling temperature. For a
    callback that needs a forward outside the step (e.g. after the update): ``policy_forward(module.policy,
    record.batch, record.minis, module.rollout.temperature)``; every rank must call it (FSDP2's collectives)."""
    logprobs, entropy = (torch.zeros(batch.loss_mask[:, 1:].shape, device=batch.input_ids.device) for _ in "le")
    for rows, sub in micro_batches(batch, minis):
        out = policy.outputs(sub.input_ids, sub.attention_mask, sub.loss_mask, temperature, routing=sub.routing,
                             images=sub.images)
        if rows:
            idx, cut = torch.tensor(rows, device=logprobs.device), sub.input_ids.shape[1] - 1
            logprobs[idx, :cut], entropy[idx, :cut] = out.logprobs, out.entropy
    return logprobs, entropy


@torch.no_grad()
def constants(policy, reference, batch: Batch, minis: list[MiniBatch], temperature: float, optimizer_steps: int,
              trainer, teacher=None, entropy: bool = False) -> Constants:
    """PPO's old logprobs (when the batch makes more than one optimizer step), the reference's logprobs (KL), the
    teacher's (distillation; a teacher engine's come with the batch), the value head's predictions (critic) and the
    policy's entropies (``entropy``: a token selection reads them), each (N, T-1), filled on this rank's rows (values
    and entropies gathered from every rank: advantages and selections see the whole batch); nothing when none is
    needed."""
    scored = None if batch.teacher_logprobs is None else batch.teacher_logprobs[:, 1:]  # by a teacher on an engine
    if optimizer_steps == 1 and reference is None and policy.value_head is None and teacher is None and not entropy:
        return Constants(teacher=scored)
    shape, device = batch.loss_mask[:, 1:].shape, batch.input_ids.device  # (N, T-1)

    def zeros(needed: bool):
        return torch.zeros(shape, device=device) if needed else None

    consts = Constants(old=zeros(optimizer_steps > 1), ref=zeros(reference is not None),
                       values=zeros(policy.value_head is not None),
                       teacher=zeros(teacher is not None) if scored is None else scored, entropy=zeros(entropy))
    frozen = [(consts.ref, reference), (consts.teacher, teacher)]
    own = [(consts.old, "logprobs"), (consts.values, "values"), (consts.entropy, "entropy")]
    mine = []
    for rows, sub in micro_batches(batch, minis):
        args = (sub.input_ids, sub.attention_mask, sub.loss_mask, temperature)
        out = (policy.outputs(*args, routing=sub.routing, images=sub.images)
               if any(into is not None for into, _ in own) else None)
        scored = [(into, model.outputs(*args, images=sub.images).logprobs) for into, model in frozen
                  if model is not None]
        if rows:
            idx, cut = torch.tensor(rows, device=device), sub.input_ids.shape[1] - 1
            for into, name in own:
                if into is not None:
                    into[idx, :cut] = getattr(out, name)
            for into, logprobs in scored:
                into[idx, :cut] = logprobs
            mine += rows
    for shared in (consts.values, consts.entropy):  # advantages and selections see every rank's rows
        if shared is not None:
            for rows, part in parallel.all_gather((mine, shared[mine].cpu()), trainer):
                shared[rows] = part.to(device)
    return consts


class StepMetrics:
    """Combines the metrics of a step's micro-batches and ranks: the loss terms add up over a mini-batch (they are
    normalized by its counts) and are averaged over optimizer steps; ``*_min``/``*_max`` by min/max; the rest are
    token-weighted means."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.weighted: dict[str, float] = {}
        self.extreme: dict[str, float] = {}
        self.tokens, self.steps, self.grad_norm = 0.0, 0, 0.0

    def add(self, metrics: dict[str, torch.Tensor], tokens: float) -> None:
        self.tokens += tokens
        for k, v in metrics.items():
            v = float(v)
            if k in ADDITIVE_METRICS:
                self.sums[k] = self.sums.get(k, 0.0) + v
            elif k.endswith("_min") or k.endswith("_max"):
                pick = min if k.endswith("_min") else max
                self.extreme[k] = pick(self.extreme.get(k, v), v)
            else:
                self.weighted[k] = self.weighted.get(k, 0.0) + v * tokens

    def step(self, grad_norm: torch.Tensor) -> None:
        self.steps += 1
        full = getattr(grad_norm, "full_tensor", None)  # a DTensor under FSDP2
        self.grad_norm += float(full() if full else grad_norm)

    def reduce(self, trainer) -> dict[str, float]:
        t = torch.tensor([self.sums[k] for k in sorted(self.sums)] + [self.weighted[k] for k in sorted(self.weighted)]
                         + [self.tokens], dtype=torch.float64)
        t = parallel.all_reduce(t, trainer).tolist()
        out = {k: v / self.steps for k, v in zip(sorted(self.sums), t)}
        out.update({k: v / max(t[-1], 1.0) for k, v in zip(sorted(self.weighted), t[len(self.sums):])})
        for k in sorted(self.extreme):
            op = torch.distributed.ReduceOp.MIN if k.endswith("_min") else torch.distributed.ReduceOp.MAX
            out[k] = float(parallel.all_reduce(torch.tensor([self.extreme[k]]), trainer, op))
        out["grad_norm"] = self.grad_norm / max(self.steps, 1)
        return out
