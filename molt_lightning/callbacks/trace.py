"""``RunTrace``: the record of what the loop did, written into the run folder as the run goes (``trace.jsonl.gz``),
what ``molt view`` shows below the curves.

The file is a sequence of gzip members, one JSON object each, appended and flushed as it happens (a thread of the
callback's own builds and writes them: the step only hands its record over), so a run killed mid-write leaves every
earlier entry readable (``read`` skips a torn member and counts it). Entries, by ``type``:

- ``run``: at each (re)start of training: the format, the step it starts at, the run's settings that explain samples
  (group size, max_lag, temperature, token selection);
- ``step``: per training step: its wall-clock end, the trainer's phases (waiting for rollouts, compute, weight sync,
  in seconds), the weight sync (the version pushed, bytes, whether the engine's fingerprints matched), every scalar
  the step logged (``metrics``), the batch's groups (id, prompt, members' rewards, statuses, policy-token counts,
  generation start/end), and a bounded sample of whole groups (``groups_per_step``, spread over the batch) with
  every token: id, text piece, span kind (0 prompt, 1 policy, 2 environment or tool), the policy version that
  sampled it, the engine's and the trainer's logprob, the advantage, the importance weight, the entropy and whether
  the loss trained on it (a policy token not trained on was left out by token selection; context is never trained
  on). Per-token arrays hold one value per token, ``null`` where there is none (the first token, context tokens);
- ``outcast``: samples not trained on this step (failed, stale, filtered by the group filter), with their cause and
  text, at most ``outcasts_per_step`` of them a step (the counts of all are in ``metrics``);
- ``eval``: a held-out round (``Evaluate``): its step, version, seconds, metrics and ``eval_samples`` of its runs;
- ``checkpoint``: a checkpoint saved (step, version); ``engine``: an engine went down or came back.

Written by hand: Lightning's loggers hold scalars, and no maintained library records per-token training data.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import queue
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch

from ..trajectory import Kind, Trajectory

log = logging.getLogger(__name__)
FILENAME = "trace.jsonl.gz"
FORMAT = 1
MAGIC = b"\x1f\x8b\x08"  # a gzip member's first bytes
READ_CHUNK = 1 << 14
KIND_CODES = {Kind.PROMPT: 0, Kind.POLICY: 1, Kind.ENV: 2}


class RunTrace(L.Callback):
    """Rank 0 writes ``trace.jsonl.gz`` in the run folder (none without a logger)."""

    def __init__(self, groups_per_step: int = 2, outcasts_per_step: int = 8, eval_samples: int = 4,
                 filename: str = FILENAME):
        if min(groups_per_step, outcasts_per_step, eval_samples) < 0:
            raise ValueError("RunTrace: groups_per_step, outcasts_per_step and eval_samples must be >= 0")
        self.groups_per_step, self.outcasts_per_step = groups_per_step, outcasts_per_step
        self.eval_samples = eval_samples
        self.filename, self.path, self._pieces, self._down, self._saved = filename, None, {}, set(), None

    # ----- hooks -----
    def on_train_start(self, trainer, pl_module) -> None:
        self.path = None  # a callback used again: a run without a logger writes nothing (not into the last run's file)
        if trainer.global_rank != 0 or trainer.logger is None or not trainer.logger.log_dir:
            return
        self.path = Path(trainer.logger.log_dir) / self.filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._queue, self.failures = queue.SimpleQueue(), 0
        self._writer = threading.Thread(target=self._drain, name="molt-trace", daemon=True)
        self._writer.start()
        r, a = pl_module.rollout, pl_module.algo
        self.submit({"type": "run", "format": FORMAT, "time": time.time(), "step": trainer.global_step,
                     "version": pl_module.policy_version, "group_size": r.group_size,
                     "prompts_per_step": r.prompts_per_step, "max_lag": r.max_lag, "temperature": r.temperature,
                     "token_selection": a.token_selection, "policy": str(pl_module.hparams.policy)})
        self._t = time.time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.path is None:
            return
        record, now, step, tokenizer = outputs["record"], time.time(), pl_module.policy_version - 1, pl_module.tokenizer
        self._events(trainer, pl_module, step)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        sync = outputs.get("weight_sync_s")
        entry = {"type": "step", "step": step, "version": record.version, "start": self._t, "end": now,
                 "phases": {"wait_rollouts": record.trainer_idle_s, "train": record.train_compute_s,
                            "weight_sync": sync or 0.0},
                 "sync": None if sync is None else {"version": pl_module.policy_version, "seconds": sync,
                                                    "bytes": outputs.get("sync_bytes"),
                                                    "verified": metrics.get("sync/verified")},
                 "metrics": metrics}
        outcasts = pl_module.source.take_outcasts()[: self.outcasts_per_step] if pl_module._started else []
        self.submit(lambda: [  # built on the writer thread: the record's tensors are this step's own
            {**entry, "batch": _batch_groups(record.batch.trajectories), "groups": self._groups(record, tokenizer)},
            *({"type": "outcast", "step": step, "cause": cause, **self._sample(traj, tokenizer)}
              for cause, traj in outcasts)])
        self._t = now

    def on_fit_end(self, trainer, pl_module) -> None:  # after every callback's on_train_end (Evaluate's last round)
        if self.path is not None:
            self._events(trainer, pl_module, pl_module.policy_version - 1)
            self.close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.close()

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if self.path is not None and self._saved != trainer.global_step:  # (save_last saves the step twice)
            self._saved = trainer.global_step
            self.submit({"type": "checkpoint", "step": trainer.global_step - 1, "version": pl_module.policy_version,
                         "time": time.time()})

    # ----- writing (on a thread of its own: the trainer's step only hands the entries over) -----
    def submit(self, entry: dict | Callable[[], list[dict]]) -> None:
        """An entry, or a function that builds entries on the writer thread (here, once it has stopped: a checkpoint
        saved after training ended)."""
        if self.path is None:
            return
        if self._writer.is_alive():
            self._queue.put(entry)
        else:
            for e in entry() if callable(entry) else [entry]:
                self.write(e)

    def close(self) -> None:
        """Write what was submitted, then stop the writer."""
        if self.path is not None and self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
            if self.failures:
                log.warning("the run's record (%s) lost %d entries that could not be built", self.path, self.failures)

    def _drain(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                for entry in item() if callable(item) else [item]:
                    self.write(entry)
            except Exception:  # noqa: BLE001 (a record is not worth a run: counted, logged at the end)
                self.failures += 1
                log.exception("RunTrace: an entry could not be built")

    def write(self, entry: dict) -> None:
        """One gzip member holding one JSON line, appended and flushed (a torn write loses only itself)."""
        with open(self.path, "ab") as f:
            f.write(gzip.compress((json.dumps(entry, default=str) + "\n").encode(), compresslevel=6, mtime=0))

    def _events(self, trainer, pl_module, step: int) -> None:
        """Held-out rounds that ended, engines that went down or came back."""
        from .evaluate import Evaluate

        for cb in trainer.callbacks:
            while isinstance(cb, Evaluate) and cb.finished:
                r = cb.finished.pop(0)
                samples = [self._sample(t, pl_module.tokenizer) for t in r["trajectories"][: self.eval_samples]]
                self.submit({"type": "eval", **{k: v for k, v in r.items() if k != "trajectories"},
                             "samples": samples})
        engines = getattr(pl_module.engine, "members", None) or [pl_module.engine]
        down = {str(getattr(e, "where", i)) for i, e in enumerate(engines) if not getattr(e, "healthy", True)}
        for where in down ^ self._down:
            self.submit({"type": "engine", "step": step, "time": time.time(), "engine": where,
                         "state": "down" if where in down else "up",
                         "reason": getattr(pl_module.engine, "_down_reason", "") if where in down else ""})
        self._down = down

    def _groups(self, record, tokenizer) -> list[dict]:
        """``groups_per_step`` of this rank's groups, spread over the batch, every token of every member."""
        batch, mine = record.batch, set(record.rows)
        rows_of: dict[int, list[int]] = {}
        for row, t in enumerate(batch.traj_ids.tolist()):
            rows_of.setdefault(t, []).append(row)
        groups: dict[int, list[int]] = {}
        for t_idx, traj in enumerate(batch.trajectories):
            if all(r in mine for r in rows_of.get(t_idx, [])):
                groups.setdefault(traj.group_id, []).append(t_idx)
        ids = list(groups)
        n = min(self.groups_per_step, len(ids))
        chosen = [ids[i * len(ids) // n] for i in range(n)] if n else []
        rows = sorted(r for g in chosen for t in groups[g] for r in rows_of.get(t, []))
        if not rows:
            return []
        width = int(batch.attention_mask[rows].sum(1).max())
        idx = torch.tensor(rows)
        cols = {"version": batch.versions[idx, :width].tolist()}
        per_pos = {"engine_lp": record.engine_logprobs, "trainer_lp": record.logprobs, "adv": record.advantages,
                   "entropy": record.entropy, "is_weight": record.is_weight}
        for name, t in per_pos.items():  # (N, T-1): position t holds token t + 1's value
            if t is not None:
                cols[name] = torch.round(t[idx, : width - 1].double() * 1e4).div(1e4).tolist()
        trained = record.loss_mask[idx, : width - 1].tolist()
        input_ids = batch.input_ids[idx, :width].tolist()
        lengths = batch.attention_mask[idx].sum(1).tolist()
        at = {r: i for i, r in enumerate(rows)}
        out = []
        for g in chosen:
            members = []
            for t_idx in groups[g]:
                traj, segments = batch.trajectories[t_idx], []
                rowed = [seg for seg in traj.segments if any(s.kind == Kind.POLICY and s.token_ids for s in seg)]
                for seg, row in zip(rowed, rows_of.get(t_idx, [])):  # collate's rows: segments with policy tokens
                    i, n_tok = at[row], lengths[at[row]]
                    kinds = [KIND_CODES[s.kind] for s in seg for _ in s.token_ids]
                    policy = [k == 1 for k in kinds]
                    segment = {"tokens": input_ids[i][:n_tok], "text": self._text(input_ids[i][:n_tok], tokenizer),
                               "kind": kinds, "trained": [None] + [bool(x) if p else None
                                                                  for x, p in zip(trained[i], policy[1:n_tok])]}
                    segment["version"] = [v if p else None for v, p in zip(cols["version"][i][:n_tok], policy)]
                    for name in per_pos:
                        if name in cols:
                            vals = [None] + cols[name][i][: n_tok - 1]
                            segment[name] = [v if p else None for v, p in zip(vals, policy)]
                    segments.append(segment)
                members.append({**_summary(traj), "segments": segments})
            out.append({"group": g, "sample_id": batch.trajectories[groups[g][0]].sample_id, "members": members})
        return out

    def _sample(self, traj: Trajectory, tokenizer) -> dict:
        """A sample that was not trained on (or a held-out run): its spans' text, kinds and policy versions."""
        spans = [{"kind": KIND_CODES[s.kind], "text": tokenizer.decode(s.token_ids),
                  **({"versions": sorted(set(s.versions))} if s.versions else {})}
                 for seg in traj.segments for s in seg]
        return {**_summary(traj), "spans": spans}

    def _text(self, ids: list[int], tokenizer) -> list[str]:
        """Each token's text piece (decoded once per id and kept); a character whose bytes span several tokens
        (byte-level BPE: each alone decodes to U+FFFD) is given whole to its first token, "" to the others."""
        for i in set(ids) - self._pieces.keys():
            self._pieces[i] = tokenizer.decode([i])
        out, j = [self._pieces[i] for i in ids], 0
        while j < len(out):
            if "\ufffd" in out[j]:
                k = next((k for k in range(j + 2, min(j + 4, len(ids)) + 1)
                          if "\ufffd" not in tokenizer.decode(ids[j:k])), None)  # UTF-8: at most 4 bytes
                if k is not None:
                    out[j:k] = [tokenizer.decode(ids[j:k])] + [""] * (k - j - 1)
                    j = k - 1
            j += 1
        return out


def _summary(traj: Trajectory) -> dict:
    return {"sample_id": traj.sample_id, "member": traj.member, "reward": traj.reward if traj.reward == traj.reward
            else None, "status": traj.status.value, "reason": traj.reason,
            "truncation": traj.truncation.value if traj.truncation else None, "turns": traj.num_turns,
            "tool_turns": sum(1 for seg in traj.segments for s in seg if s.kind == Kind.ENV),
            "policy_tokens": traj.num_policy_tokens, "started": traj.started, "ended": traj.ended,
            "info": {k: v for k, v in traj.info.items() if isinstance(v, (str, int, float, bool, type(None)))}}


def _batch_groups(trajectories: list[Trajectory]) -> list[dict]:
    """Every group of the batch in brief (for the step view and the timeline)."""
    groups: dict[int, dict] = {}
    for t in trajectories:
        g = groups.setdefault(t.group_id, {"group": t.group_id, "sample_id": t.sample_id, "rewards": [],
                                           "statuses": [], "tokens": [], "started": t.started, "ended": t.ended})
        g["rewards"].append(t.reward)
        g["statuses"].append(t.status.value)
        g["tokens"].append(t.num_policy_tokens)
        g["started"], g["ended"] = min(g["started"], t.started), max(g["ended"], t.ended)
    return list(groups.values())


def read(path: str | os.PathLike) -> tuple[list[dict], int]:
    """The entries of a trace file and how many torn or unreadable members were skipped (a write cut short; a resumed
    run appends after it, so reading goes on at the next member's header)."""
    got = [entry for _, _, entry in members(Path(path).read_bytes())]
    return [e for e in got if e is not None], sum(e is None for e in got)


def members(data: bytes, start: int = 0):
    """``(offset, end, entry)`` for each gzip member of ``data`` from ``start``: ``entry`` None for bytes that hold no
    readable entry (from ``offset`` to the next member's header, or to the end: a torn tail, or one being written)."""
    view, pos = memoryview(data), start
    while pos < len(data):
        d, text, fed = zlib.decompressobj(wbits=31), [], pos
        try:  # fed a chunk at a time: what is left over is at most a chunk, not the rest of the file (time linear)
            while not d.eof and fed < len(data):
                text.append(d.decompress(view[fed:fed + READ_CHUNK]))
                fed = min(fed + READ_CHUNK, len(data))
            entry = json.loads(b"".join(text)) if d.eof else None  # not at eof: the member ends before its trailer
        except (zlib.error, ValueError):
            entry = None
        if entry is None:
            at = data.find(MAGIC, pos + 1)
            end = at if at > 0 else len(data)
        else:
            end = fed - len(d.unused_data)
        yield pos, end, entry
        pos = end
