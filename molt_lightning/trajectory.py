"""Trajectory records and the batch they become: where the training-data consistency invariant is enforced.

A trajectory is what one agent run produced: one or more *segments* (a segment is one token sequence the trainer sees;
an agent that rewrites its history starts a new one), each a list of *spans*: ``prompt`` and ``env`` spans are
context (never trained on), ``policy`` spans are tokens the engine sampled, each with the engine's logprob and the
integer policy version that sampled it. Policy spans are only made from engine output (``Span.policy``), so a trained
token always has an engine record; ``collate`` checks it again and raises on a violation (a bug, not a warning).
A trajectory cut short (status ``TRUNCATED``, trained on like an ok one) records its first cause as a ``Truncation``
(a turn at max_tokens, at the context's end, an episode at max_turns, the environment's stop); ``Outcomes.truncation``
codes it per trajectory (``TRUNCATION_CODES``) for the trainer.

Mixture-of-experts policies add one per-token fact, like logprobs and versions: the experts each position was routed
to by the engine (``Span.routing``, (n, layers, k) int16, ``moe.NO_RECORD`` rows where the engine never forwarded
the position). ``place_routing`` puts an engine call's rows onto its segment's spans, keeping every position's first
record; ``collate`` stacks them into ``Batch.routing`` (one function, ``_routing``), which routing replay consumes.

On-policy distillation with the teacher on an engine adds one more per-token fact: the teacher's logprob of each
sampled token (``Span.teacher``, set on the rollout side by ``rollout.source.score_with``), stacked by ``collate``
into ``Batch.teacher_logprobs``; a batch has it on every policy token or on none.

Vision-language policies add per-trajectory inputs: the pixel values of the images whose placeholder tokens a
context span holds (``Span.images``, a ``vision.ImageInputs``, set by the client from the processor's output);
``collate`` checks each span holds exactly its images' tokens and gathers every row's images, in order, into
``Batch.images`` (one function, ``vision.collate_images``), which the policy's forward takes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from .policies.moe import NO_RECORD, ROUTING_DTYPE
from .policies.vision import BatchImages, ImageInputs, collate_images


class Kind(str, Enum):
    PROMPT = "prompt"
    POLICY = "policy"
    ENV = "env"


class Status(str, Enum):
    OK = "ok"
    TRUNCATED = "truncated"  # cut short (``Trajectory.truncation`` says why); trained on like an ok one, and counted
    FAILED = "failed"  # the agent raised, timed out or returned a bad reward; never trained on


class Truncation(str, Enum):
    """Why a trajectory was cut short (its first cause: ``Trajectory.truncate``)."""

    MAX_TOKENS = "max_tokens"  # a turn hit the max_tokens it asked for (the client's ``generate``)
    MAX_TURNS = "max_turns"  # an episode was not done after max_turns replies (``agents.env.play``, verifiers')
    ENVIRONMENT = "environment"  # the environment stopped the episode on another limit of its own (verifiers' token
    # budgets, a failed compaction)
    CONTEXT = "context"  # a turn sent without max_tokens (the client gives it the rest of max_context) used it all


TRUNCATION_CODES = {cause: i + 1 for i, cause in enumerate(Truncation)}  # ``Outcomes.truncation``: 0 none


class ConsistencyError(RuntimeError):
    """A token would be trained on without an engine record, or with an impossible version."""


class ContextOverflow(RuntimeError):
    """A segment would grow past the run's ``max_context`` (the agent's client refuses the request)."""


@dataclass
class Span:
    kind: Kind
    token_ids: list[int]
    logprobs: list[float] | None = None  # policy spans: the engine's logprob of each sampled token
    versions: list[int] | None = None  # policy spans: the policy version that sampled each token
    routing: torch.Tensor | None = None  # MoE policies, any kind: (n, layers, k) int16 experts, NO_RECORD rows
    images: ImageInputs | None = None  # VLM context spans: the images whose expanded image tokens this span holds
    turn: int = -1  # policy spans: the engine call (0, 1, ...) of the trajectory that made it; -1: its order
    teacher: list[float] | None = None  # policy spans, a teacher on an engine: its logprob of each token (``score``)

    @classmethod
    def policy(cls, token_ids: list[int], logprobs: list[float], versions: list[int], turn: int = -1) -> Span:
        return cls(Kind.POLICY, list(token_ids), list(logprobs), list(versions), turn=turn)

    @classmethod
    def context(cls, kind: Kind, token_ids: list[int], images: ImageInputs | None = None) -> Span:
        if kind == Kind.POLICY:
            raise ConsistencyError("a policy span needs engine logprobs and versions: use Span.policy")
        return cls(kind, list(token_ids), images=images)


def segment_images(segment: list[Span]) -> ImageInputs | None:
    """All images of a segment, in token order (what an engine needs with the segment as its prompt)."""
    return ImageInputs.cat([s.images for s in segment])


def place_routing(segment: list[Span], routing: torch.Tensor | None) -> None:
    """Put an engine call's routing record (P, layers, k), for the segment's first P positions, onto its spans: each
    position keeps its first record (an earlier turn's tokens keep the routing they were sampled with); positions
    the record does not reach (the last generated token) get ``NO_RECORD`` rows, which a later call fills."""
    if routing is None:
        return
    start = 0
    for span in segment:
        n = len(span.token_ids)
        rows = torch.full((n, *routing.shape[1:]), NO_RECORD, dtype=ROUTING_DTYPE)  # (n, layers, k)
        got = routing[start:start + n]  # (<= n, layers, k)
        rows[: len(got)] = got
        if span.routing is None:
            span.routing = rows
        else:
            missing = span.routing[:, 0, 0] == NO_RECORD  # (n,)
            span.routing[missing] = rows[missing]
        start += n


@dataclass
class Trajectory:
    sample_id: int  # position of the prompt in the task stream
    group_id: int
    segments: list[list[Span]] = field(default_factory=lambda: [[]])
    reward: float = math.nan
    status: Status = Status.OK
    reason: str = ""
    truncation: Truncation | None = None  # why it was cut short (the first cause); None unless status is TRUNCATED
    info: dict[str, Any] = field(default_factory=dict)
    turns: int = 0  # engine calls made (the client counts them; an empty generation is a turn too)
    turn_rewards: list[float] | None = None  # the agent's reward per turn (``AgentResult.turn_rewards``)
    turn_keys: list | None = None  # the agent's state key per turn (``AgentResult.turn_keys``; GiGPO)
    member: int | str = 0  # its place in the group (an evaluation's runs: "eval0", "eval1", ...)
    sample: dict | None = None  # the task sample its agent ran on
    started: float = 0.0  # wall-clock seconds (time.time()) its agent run started and ended (the rollout source)
    ended: float = 0.0

    def policy_spans(self):
        return (s for seg in self.segments for s in seg if s.kind == Kind.POLICY)

    @property
    def num_policy_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.policy_spans())

    @property
    def oldest_version(self) -> int | None:
        """The version the staleness bound applies to (a trajectory may span several weight updates)."""
        return min((min(s.versions) for s in self.policy_spans() if s.versions), default=None)

    @property
    def num_turns(self) -> int:
        """Turns: engine calls, or policy spans for a trajectory made by hand (whose spans carry no turn)."""
        return max(self.turns, sum(1 for _ in self.policy_spans()))

    def truncate(self, cause: Truncation, reason: str) -> None:
        """Mark it cut short by ``cause`` (``reason`` says it in words), unless it already failed or was cut: the
        first cause stays."""
        if self.status == Status.OK:
            self.status, self.reason, self.truncation = Status.TRUNCATED, reason, Truncation(cause)

    def fail(self, reason: str) -> Trajectory:
        self.status, self.reason, self.truncation = Status.FAILED, reason, None
        return self


def repeats(trajectories: list[Trajectory]) -> int:
    """How many of ``trajectories`` repeat an earlier one of their group token for token (all their policy tokens, in
    order): a group of G with d distinct completions repeats G - d. Its share of a batch is ``samples/duplicates``:
    engines that sample from one random stream raise it (half of a group's samples were copies with two servers
    seeded alike), and so does a policy that has become sure of its answer."""
    return len(trajectories) - len({(t.group_id, tuple(x for s in t.policy_spans() for x in s.token_ids))
                                    for t in trajectories})


@dataclass
class Outcomes:
    """Per trajectory of a batch (M of them, in ``Batch.trajectories`` order): what the advantages are made of.

    ``turn_rewards`` (M, K) holds each turn's reward (K: the most turns of any trajectory; NaN past a trajectory's
    last turn): the agent's ``turn_rewards`` where it gave them, else its reward on its last turn and 0 before (an
    outcome reward arrives at the end). ``turn_keys`` (M, K) numbers the agent's per-turn state keys (equal keys, equal
    numbers, within the batch; -1 where none was given). ``truncation`` (M,) codes why each was cut short:
    ``TRUNCATION_CODES[cause]`` (1 + the cause's index in ``Truncation``), 0 where it was not (or was marked
    ``TRUNCATED`` by hand, without a cause: ``truncated`` is then True)."""

    rewards: torch.Tensor  # (M,) float32
    lengths: torch.Tensor  # (M,) long: policy tokens over all of its turns
    groups: torch.Tensor  # (M,) long: its group (prompt)
    truncated: torch.Tensor | None = None  # (M,) bool: status TRUNCATED (any cause: ``truncation``)
    turns: torch.Tensor | None = None  # (M,) long: turns (engine calls)
    turn_rewards: torch.Tensor | None = None  # (M, K) float32, NaN past the last turn
    turn_keys: torch.Tensor | None = None  # (M, K) long, -1 where no key
    truncation: torch.Tensor | None = None  # (M,) long: 0 none, else 1 + index of the cause in Truncation

    def to(self, device) -> Outcomes:
        return Outcomes(**{k: None if v is None else v.to(device) for k, v in vars(self).items()})

    @classmethod
    def of(cls, trajectories: list[Trajectory]) -> Outcomes:
        turns = [t.num_turns for t in trajectories]
        width, keys = max(max(turns), 1), {}
        turn_rewards = torch.full((len(trajectories), width), math.nan)  # (M, K)
        turn_keys = torch.full((len(trajectories), width), -1, dtype=torch.long)  # (M, K)
        for m, (t, n) in enumerate(zip(trajectories, turns)):
            for given in (t.turn_rewards, t.turn_keys):
                if given is not None and len(given) != n:
                    raise ConsistencyError(f"sample {t.sample_id}: {len(given)} per-turn values for {n} turns")
            if t.turn_rewards is not None:
                turn_rewards[m, :len(t.turn_rewards)] = torch.tensor(t.turn_rewards, dtype=torch.float32)
            elif n:
                turn_rewards[m, :n] = 0.0
                turn_rewards[m, n - 1] = t.reward
            for k, key in enumerate(t.turn_keys or []):
                turn_keys[m, k] = keys.setdefault(key, len(keys))
        return cls(rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
                   lengths=torch.tensor([t.num_policy_tokens for t in trajectories], dtype=torch.long),
                   groups=torch.tensor([t.group_id for t in trajectories], dtype=torch.long),
                   truncated=torch.tensor([t.status == Status.TRUNCATED for t in trajectories]),
                   turns=torch.tensor(turns, dtype=torch.long), turn_rewards=turn_rewards, turn_keys=turn_keys,
                   truncation=torch.tensor([TRUNCATION_CODES.get(t.truncation, 0) for t in trajectories],
                                           dtype=torch.long))


@dataclass
class Batch:
    """One training batch: a row per segment, every per-token field aligned with ``input_ids``; ``outcomes`` per
    trajectory."""

    input_ids: torch.Tensor  # (N, T) long, right-padded
    attention_mask: torch.Tensor  # (N, T) bool
    loss_mask: torch.Tensor  # (N, T) bool: policy tokens
    engine_logprobs: torch.Tensor  # (N, T) float32, 0 off the loss mask
    versions: torch.Tensor  # (N, T) long, -1 off the loss mask
    turns: torch.Tensor  # (N, T) long: the turn of its trajectory each policy token belongs to, -1 off the loss mask
    group_ids: torch.Tensor  # (N,) long
    traj_ids: torch.Tensor  # (N,) long, index of the trajectory in ``trajectories``
    trajectories: list[Trajectory]
    outcomes: Outcomes
    routing: torch.Tensor | None = None  # (N, T, layers, k) int16 engine experts, NO_RECORD off record; None: dense
    images: BatchImages | None = None  # VLM: pixel values (I, 3, H, W) and each image's row (I,); None: text only
    teacher_logprobs: torch.Tensor | None = None  # (N, T) float32 a teacher engine's, 0 off the loss mask; or None

    def to(self, device) -> Batch:
        moved = {k: v.to(device) for k, v in vars(self).items()
                 if isinstance(v, (torch.Tensor, BatchImages, Outcomes))}
        return Batch(**{**vars(self), **moved})


def collate(trajectories: list[Trajectory], pad_id: int, max_version: int | None = None, max_lag: int | None = None
            ) -> Batch:
    """Build the padded batch, checking the invariant on every trained token."""
    rows = []
    for t_idx, traj in enumerate(trajectories):
        if traj.status == Status.FAILED:
            raise ConsistencyError(f"sample {traj.sample_id} failed ({traj.reason}) and must not reach a batch")
        if not math.isfinite(traj.reward):
            raise ConsistencyError(f"sample {traj.sample_id} has a non-finite reward {traj.reward}")
        order = 0  # policy spans so far: the turn of a span made without one
        for seg in traj.segments:
            ids, mask, lps, vers, turns, teacher = [], [], [], [], [], []
            for span in seg:
                n, policy = len(span.token_ids), span.kind == Kind.POLICY
                if policy:
                    _check_policy_span(span, traj.sample_id, max_version, max_lag)
                ids += span.token_ids
                mask += [policy] * n
                lps += span.logprobs if policy else [0.0] * n
                vers += span.versions if policy else [-1] * n
                turns += [(span.turn if span.turn >= 0 else order) if policy else -1] * n
                teacher += (span.teacher or [None] * n) if policy else [0.0] * n
                order += policy
                if span.routing is not None and span.routing.shape[0] != n:
                    raise ConsistencyError(f"sample {traj.sample_id}: {n} tokens but {span.routing.shape[0]} "
                                           "routing rows")
                if span.images is not None:
                    _check_images(span, traj.sample_id)
            if not any(mask):
                continue  # a segment with nothing generated carries no signal
            if mask[0]:
                raise ConsistencyError(f"sample {traj.sample_id}: a segment starts with a policy token (no prompt)")
            _check_row_images(ids, segment_images(seg), traj.sample_id)
            rows.append((ids, mask, lps, vers, traj.group_id, t_idx, seg, turns, teacher))
    if not rows:
        raise ConsistencyError("no trainable tokens in this batch")
    scored = [x is not None for r in rows for x, policy in zip(r[8], r[1]) if policy]  # a teacher engine's logprobs
    if any(scored) and not all(scored):  # a bug: the rollout side scores every usable trajectory of a run, or none
        raise ConsistencyError("some policy tokens of the batch have a teacher's logprob and others none")
    width = max(len(r[0]) for r in rows)

    def padded(k: int, fill, dtype) -> torch.Tensor:  # one tensor per field from padded lists: no per-row copies
        return torch.tensor([r[k] + [fill] * (width - len(r[k])) for r in rows], dtype=dtype)

    return Batch(
        input_ids=padded(0, pad_id, torch.long),
        attention_mask=torch.tensor([[True] * len(r[0]) + [False] * (width - len(r[0])) for r in rows]),
        loss_mask=padded(1, False, torch.bool),
        engine_logprobs=padded(2, 0.0, torch.float32),
        versions=padded(3, -1, torch.long),
        turns=padded(7, -1, torch.long),
        group_ids=torch.tensor([r[4] for r in rows], dtype=torch.long),
        traj_ids=torch.tensor([r[5] for r in rows], dtype=torch.long),
        trajectories=trajectories,
        outcomes=Outcomes.of(trajectories),
        routing=_routing([r[6] for r in rows], width),
        images=collate_images([segment_images(r[6]) for r in rows]),
        teacher_logprobs=padded(8, 0.0, torch.float32) if any(scored) else None,
    )


def _routing(segments: list[list[Span]], width: int) -> torch.Tensor | None:
    """``Batch.routing`` (N, width, layers, k) int16 from the rows' spans, ``NO_RECORD`` where a span has no record
    and on padding; None when no span has one (a dense policy)."""
    shape = next((s.routing.shape[1:] for seg in segments for s in seg if s.routing is not None), None)
    if shape is None:
        return None
    out = torch.full((len(segments), width, *shape), NO_RECORD, dtype=ROUTING_DTYPE)  # (N, T, layers, k)
    for row, seg in enumerate(segments):
        start = 0
        for span in seg:
            if span.routing is not None:
                out[row, start:start + len(span.token_ids)] = span.routing
            start += len(span.token_ids)
    return out


def _check_images(span: Span, sample_id: int) -> None:
    """A span's image tokens are exactly its images' (``tokens_per_image`` each): what the VLM's forward needs."""
    img, found = span.images, span.token_ids.count(span.images.token_id)
    if span.kind == Kind.POLICY or found != len(img) * img.tokens_per_image:
        raise ConsistencyError(f"sample {sample_id}: a {span.kind.value} span holds {found} image tokens for "
                               f"{len(img)} images of {img.tokens_per_image} tokens each")


def _check_row_images(ids: list[int], images: ImageInputs | None, sample_id: int) -> None:
    """A row's image tokens are its images' and nothing else (e.g. not a placeholder the policy generated)."""
    if images is not None and ids.count(images.token_id) != len(images) * images.tokens_per_image:
        raise ConsistencyError(f"sample {sample_id}: the row holds {ids.count(images.token_id)} image tokens for "
                               f"{len(images)} images of {images.tokens_per_image}: a policy or template token is "
                               "the image placeholder (the client fails such trajectories)")


def _check_policy_span(span: Span, sample_id: int, max_version: int | None, max_lag: int | None) -> None:
    n = len(span.token_ids)
    if span.logprobs is None or span.versions is None or len(span.logprobs) != n or len(span.versions) != n or \
            (span.teacher is not None and len(span.teacher) != n):
        raise ConsistencyError(f"sample {sample_id}: policy tokens without a full engine record (logprob, version)")
    if not all(math.isfinite(x) and x <= 1e-4 for x in span.logprobs):
        raise ConsistencyError(f"sample {sample_id}: engine logprobs must be finite and <= 0, got {span.logprobs}")
    oldest = 0 if max_version is None or max_lag is None else max(max_version - max_lag, 0)
    if n and (min(span.versions) < oldest or (max_version is not None and max(span.versions) > max_version)):
        raise ConsistencyError(f"sample {sample_id}: token versions {sorted(set(span.versions))} outside [{oldest}, "
                               f"trainer {max_version}] (max_lag {max_lag})")
