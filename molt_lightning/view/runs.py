"""The run folders ``molt view`` shows, read as they grow: a ``molt fit`` run (its record ``trace.jsonl.gz``, else
``metrics.csv`` and ``eval.jsonl``), a ``molt-bench`` run set (``manifest.json``, a curve per seed), or a folder that is
neither (a note says so and what it holds).

The record is indexed, not held: each entry's offset in the file and its light fields (a step's metrics, phases and
batch summary; an outcast's or a held-out round's summary); the per-token sample of a step is read back from its
offset when a page asks for it. ``refresh`` reads only what was appended since the last call, so a run still going is
followed at the cost of its new steps. Everything readable is kept when something is not (a torn entry, a metrics file
with a missing column): the problems are ``notes`` for the page, never an exception.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from ..callbacks.trace import FILENAME, FORMAT, members

LIVE_S = 120  # a run whose record changed this recently is shown as still going (its pages refresh)


@dataclass
class Trace:
    """An index of one ``trace.jsonl.gz``."""

    path: Path
    offset: int = 0  # bytes indexed so far
    skipped: int = 0  # unreadable entries skipped (a write cut short)
    torn_tail: bool = False  # the file ends inside an entry (being written, or cut short)
    starts: list[dict] = field(default_factory=list)  # ``run`` entries
    steps: dict[int, dict] = field(default_factory=dict)  # step -> its light fields and "at": (offset, end)
    outcasts: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)  # checkpoint and engine entries
    formats: set = field(default_factory=set)

    def refresh(self) -> None:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size < self.offset:  # replaced: start over
            self.__init__(self.path)
        if size == self.offset:
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        self.torn_tail, done = False, 0
        for pos, end, entry in members(data):
            if entry is None and end == len(data):
                self.torn_tail = True  # read again next time: it may be complete by then
                break
            if entry is None:
                self.skipped += 1
            else:
                self._add(entry, (self.offset + pos, self.offset + end))
            done = end
        self.offset += done

    def _add(self, entry: dict, at: tuple[int, int]) -> None:
        kind = entry.get("type")
        if kind == "run":
            self.starts.append(entry)
            self.formats.add(entry.get("format"))
        elif kind == "step":
            recorded = [{"step": entry["step"], "group": g["group"], "member": i, "sample_id": m["sample_id"],
                         "reward": m["reward"], "status": m["status"], "turns": m.get("turns"),
                         "policy_tokens": m.get("policy_tokens")}
                        for g in entry.get("groups", []) for i, m in enumerate(g["members"])]
            self.steps[entry["step"]] = {k: v for k, v in entry.items() if k != "groups"} | {"at": at,
                                                                                             "recorded": recorded}
        elif kind == "outcast":
            self.outcasts.append({k: v for k, v in entry.items() if k != "spans"} | {"at": at})
        elif kind == "eval":
            self.evals.append({k: v for k, v in entry.items() if k != "samples"} | {"at": at})
        else:
            self.events.append(entry)

    def entry(self, at: tuple[int, int]) -> dict:
        """The whole entry stored at ``at`` (an index's ``"at"``)."""
        with open(self.path, "rb") as f:
            f.seek(at[0])
            return json.loads(gzip.decompress(f.read(at[1] - at[0])))


class Run:
    """One folder given to ``molt view``."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).resolve()
        self.name = self.path.name if self.path.name not in ("", ".") else str(self.path)
        if self.path.name.startswith("version_") or self.path.name.startswith("seed_"):
            self.name = f"{self.path.parent.name}/{self.path.name}"
        self.trace = Trace(self.path / FILENAME)
        self._csv: tuple[float, pd.DataFrame | None] = (-1.0, None)

    @property
    def kind(self) -> str:
        """``fit`` (a molt fit run), ``runset`` (molt-bench), or ``none``."""
        if (self.path / "manifest.json").is_file():
            return "runset"
        if any((self.path / f).is_file() for f in (FILENAME, "metrics.csv", "eval.jsonl")):
            return "fit"
        return "none"

    def refresh(self) -> Run:
        self.trace.refresh()
        return self

    @property
    def live(self) -> bool:
        try:
            return time.time() - (self.path / FILENAME).stat().st_mtime < LIVE_S
        except FileNotFoundError:
            return False

    def notes(self) -> list[str]:
        """What the page should say about this folder before anything else."""
        if not self.path.is_dir():
            return [f"{self.path} is not a folder."]
        kind, t, out = self.kind, self.trace, []
        if kind == "none":
            held = sorted(p.name for p in self.path.iterdir())[:12]
            return [f"{self.path} is not a run folder: it has no {FILENAME}, metrics.csv, eval.jsonl or manifest.json "
                    f"(it holds: {', '.join(held) or 'nothing'}). Give molt view a run's folder, e.g. "
                    "runs/default/version_0, or a molt-bench run set."]
        if kind == "fit" and not t.path.is_file():
            out.append(f"No {FILENAME} here: a run of an older version, or one with the record turned off. Its curves "
                       "come from metrics.csv and eval.jsonl; steps, samples and the timeline need the record.")
        if t.formats - {FORMAT}:
            out.append(f"The record was written in format {sorted(t.formats - {FORMAT}, key=str)}; this viewer reads "
                       f"format {FORMAT}: what it does not know is left out.")
        if t.skipped:
            out.append(f"{t.skipped} entries of the record could not be read (a write cut short, e.g. a run killed "
                       "mid-step) and were skipped; everything after them is shown.")
        if t.torn_tail and not self.live:
            out.append("The record ends inside an entry (the run was stopped while writing it): that entry is left "
                       "out.")
        return out

    # ----- curves -----
    def metrics(self) -> pd.DataFrame:
        """One row per step, a column per scalar the step logged: from the record when it has steps, else from
        metrics.csv (Lightning's CSV, rows merged by step)."""
        if self.trace.steps:
            rows = [{"step": s, **e.get("metrics", {})} for s, e in sorted(self.trace.steps.items())]
            return pd.DataFrame(rows)
        csv = self.path / "metrics.csv"
        if not csv.is_file():
            return pd.DataFrame({"step": []})
        mtime = csv.stat().st_mtime
        if self._csv[0] != mtime:
            try:
                frame = pd.read_csv(csv)
                frame = frame.groupby("step", as_index=False).first() if "step" in frame else frame.reset_index()
            except (ValueError, pd.errors.ParserError) as e:
                frame = pd.DataFrame({"step": []}).assign(error=str(e))
            self._csv = (mtime, frame)
        return self._csv[1]

    def heldout(self) -> list[dict]:
        """Held-out rounds: step, version, and per source avg@k with its interval."""
        rounds = self.trace.evals
        if not rounds and (self.path / "eval.jsonl").is_file():
            rounds = []
            for line in (self.path / "eval.jsonl").read_text(errors="replace").splitlines():
                try:
                    rounds.append(json.loads(line))
                except ValueError:
                    continue
        out = []
        for r in rounds:
            for source, m in (r.get("metrics") or {}).items():
                name = next((k for k in m if k.startswith("avg@") and "_" not in k), None)
                if name is not None:
                    out.append({"step": r.get("step"), "version": r.get("version"), "source": source, "name": name,
                                "value": m[name], "lo": m.get(name + "_lo"), "hi": m.get(name + "_hi")})
        return out

    # ----- samples -----
    def step(self, step: int) -> dict | None:
        """The whole step entry (its recorded groups included), or None."""
        light = self.trace.steps.get(step)
        return None if light is None else self.trace.entry(tuple(light["at"]))

    def samples(self) -> list[dict]:
        """Every recorded sample in brief: the members of each step's sampled groups (trained on), then those not
        trained on (``outcast``: their index), for search."""
        out = [{**r, "trained": True, "cause": ""} for _, light in sorted(self.trace.steps.items())
               for r in light.get("recorded", [])]
        for i, o in enumerate(self.trace.outcasts):
            out.append({"step": o["step"], "group": None, "member": o.get("member"), "sample_id": o["sample_id"],
                        "reward": o.get("reward"), "status": o.get("status"), "trained": False,
                        "cause": o.get("cause", ""), "outcast": i, "reason": o.get("reason", "")})
        return out

    def text_of(self, sample: dict) -> str:
        """A recorded sample's whole text (read back from the record)."""
        if sample.get("outcast") is not None:
            return "".join(s["text"] for s in (self.outcast(sample["outcast"]) or {}).get("spans", []))
        entry = self.step(sample["step"]) or {}
        for g in entry.get("groups", []):
            if g["group"] == sample["group"] and sample["member"] < len(g["members"]):
                return "".join("".join(seg["text"]) for seg in g["members"][sample["member"]]["segments"])
        return ""

    def outcast(self, i: int) -> dict | None:
        return self.trace.entry(tuple(self.trace.outcasts[i]["at"])) if 0 <= i < len(self.trace.outcasts) else None


def expand(folders: list[str]) -> list[Run]:
    """The runs of ``folders``: a folder that is no run itself but holds runs (``runs/default``: its ``version_N``;
    a molt-bench folder of run sets) stands for them, in order."""
    out = []
    for folder in folders:
        run = Run(folder)
        inner = [Run(p) for p in sorted(run.path.iterdir(), key=_natural) if p.is_dir()] \
            if run.kind == "none" and run.path.is_dir() else []
        out += [r for r in inner if r.kind != "none"] or [run]
    return out


def _natural(path: Path) -> tuple:
    """version_2 before version_10."""
    return tuple(int(x) if x.isdigit() else x for x in re.split(r"(\d+)", path.name))


def finite(x) -> float | None:
    """A JSON-safe number (NaN and infinities become None)."""
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None
