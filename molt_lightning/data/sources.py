"""Tasks from data: local files, ``datasets`` folders and procedural generators as the run's ``tasks(seed)``.

A recipe names its sources under ``model.tasks``::

    tasks:
      class_path: molt_lightning.data.Tasks
      init_args:
        sources:
          - {path: data/train.jsonl, prompt: question, answer: answer, verifier: math}
          - {reasoning_gym: chain_sum, size: 5000, config: {min_terms: 2, max_terms: 2}, weight: 0.5}

- **Files** (``path``): JSONL, JSON, Parquet, CSV or Arrow files, or a folder written by ``datasets``'
  ``save_to_disk`` (``split`` picks one of a ``DatasetDict``), read with the ``datasets`` library, offline. A row's
  prompt is the field ``prompt`` (a text, or a list of chat messages) or ``template`` filled with the row's fields
  (``"Solve: {question}"``; write literal braces as ``{{ }}``); ``answer`` names the reference answer's field;
  ``system`` puts a system message first; ``tools`` names a field of OpenAI-style tool schemas (a list, or its JSON
  text) handed to the agent as ``sample["tools"]``.
- **Procedural libraries**: ``reasoning_gym: TASK`` makes ``size`` problems with reasoning-gym's generator (``seed``,
  ``config``) and grades them with the task's own ``score_answer`` (``verifier: reasoning_gym``, the default there);
  ``generator: pkg.mod.fn`` takes any ``fn(seed=, size=, **config)`` returning rows.
- **The sample** an agent gets: the row's fields, plus ``messages`` (the chat to send), ``answer``, ``verifier`` (the
  source's spec, see ``verifiers``), ``source`` (its name), ``row`` (its index) and ``tools`` when given.
- **Mixing and epochs**: an epoch is ``epoch_size`` samples (default: every source's rows once); source ``i``
  contributes ``round(epoch_size * weight_i / sum(weights))`` of them (no weights: its row count is its weight),
  drawn from its rows in shuffled passes, and the epoch's samples are shuffled together. ``tasks(seed)`` is one
  epoch, a pure function of ``seed``: the rollout side reads epoch ``e`` as ``tasks(task_seed + e)`` and saves which
  prompts are done in checkpoints (``admission``), so a resumed run continues mid-epoch without repeating or
  skipping a prompt.
- **Bad data** is answered when the recipe is read, before anything starts: an unreadable file, a missing field, an
  empty prompt, a template that names a field the row lacks, tools that are no list: a ``ValueError`` naming the file,
  the row and the field.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import imported
from ..extras import require
from .graders import resolve

RESERVED = ("messages", "answer", "verifier", "source", "row", "tools")
READERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


@dataclass
class Source:
    """One source of samples: a file or ``datasets`` folder (``path``), or a generator (``reasoning_gym`` /
    ``generator``); see the module docstring."""

    path: str | None = None
    reasoning_gym: str | None = None  # a reasoning-gym task name (chain_sum, basic_arithmetic, ...)
    generator: str | None = None  # dotted path of fn(seed=, size=, **config) -> rows
    size: int = 1000  # rows a generator makes
    seed: int = 0  # a generator's seed (a held-out set: a far seed; Evaluate keeps its problems out of training)
    config: dict = field(default_factory=dict)  # a generator's keyword arguments
    split: str | None = None  # the split of a DatasetDict folder
    prompt: str | None = None  # field with the prompt (text or chat messages); default "prompt" (generators: template)
    template: str | None = None  # or a format string over the row's fields
    answer: str | None = "answer"  # field with the reference answer (None: the verifier needs none)
    system: str | None = None  # a system message put first
    tools: str | None = None  # field with the row's tool schemas
    verifier: str | None = None  # see verifiers; default exact (reasoning_gym: the task's own scorer)
    name: str | None = None  # in metric names; default the file's stem or the task's name
    weight: float | None = None  # share of each epoch (None on every source: each row once per epoch)
    limit: int | None = None  # read only the first rows

    def __post_init__(self):
        kinds = [k for k in ("path", "reasoning_gym", "generator") if getattr(self, k)]
        if len(kinds) != 1:
            raise ValueError(f"a data source needs exactly one of path, reasoning_gym or generator; got "
                             f"{kinds or 'none'} ({self})")
        if self.prompt and self.template:
            raise ValueError(f"data source {self.label}: give prompt (a field) or template, not both")
        if (self.weight is not None and self.weight <= 0) or self.size < 1 or (self.limit is not None and
                                                                                self.limit < 1):
            raise ValueError(f"data source {self.label}: weight must be > 0, size and limit >= 1")
        if self.verifier is None:
            self.verifier = "reasoning_gym" if self.reasoning_gym else "exact"
        if self.prompt is None and self.template is None:
            self.prompt, self.template = ("prompt", None) if self.path else (None, "{question}")
        if self.name is None:
            self.name = (os.path.splitext(os.path.basename(self.path.rstrip("/")))[0] if self.path
                         else self.reasoning_gym or self.generator.rpartition(".")[2])
        try:
            resolve(self.verifier)
        except ValueError as e:
            raise ValueError(f"data source {self.label}: {e}") from None

    @property
    def label(self) -> str:
        return self.path or (f"reasoning_gym:{self.reasoning_gym}" if self.reasoning_gym else self.generator)


class Tasks:
    """``tasks(seed)`` over one or more sources, mixed by weight and shuffled per epoch (see the module docstring)."""

    def __init__(self, sources: list[Source], shuffle: bool = True, epoch_size: int | None = None):
        if not sources:
            raise ValueError("model.tasks: give at least one data source")
        self.sources = [s if isinstance(s, Source) else Source(**s) for s in sources]
        names = [s.name for s in self.sources]
        if len(set(names)) < len(names):
            raise ValueError(f"data sources need distinct names (set name:), got {names}")
        self.shuffle, self.rows, self.epoch_size_given = shuffle, [load(s) for s in self.sources], epoch_size
        self._plan()

    def _plan(self) -> None:
        """Each source's share of an epoch (its quota)."""
        self.epoch_size = self.epoch_size_given or sum(len(r) for r in self.rows)
        weighted = [s.weight is not None for s in self.sources]
        if any(weighted) and not all(weighted):
            raise ValueError("data sources: give every source a weight, or none (each row once per epoch)")
        weights = [s.weight if s.weight is not None else len(r) for s, r in zip(self.sources, self.rows)]
        self.quotas = [round(self.epoch_size * w / sum(weights)) for w in weights]
        if 0 in self.quotas:
            raise ValueError(f"data source {self.sources[self.quotas.index(0)].label} gets no sample in an epoch of "
                             f"{self.epoch_size}: raise its weight or epoch_size")

    def exclude(self, keys: set[str]) -> int:
        """Remove the rows whose prompt is in ``keys`` (an evaluation's held-out prompts, ``prompt_key``); returns
        how many were removed. The epochs are planned again (the rollout side has not read any yet)."""
        removed = 0
        for i, rows in enumerate(self.rows):
            kept = [s for s in rows if prompt_key(s) not in keys]
            if not kept:
                raise ValueError(f"data source {self.sources[i].label}: every row is also a held-out prompt of the "
                                 "evaluation: evaluate on other data")
            removed, self.rows[i] = removed + len(rows) - len(kept), kept
        if removed:
            self._plan()
        return removed

    def __len__(self) -> int:
        return sum(self.quotas)

    def __call__(self, seed: int = 0) -> Iterator[dict[str, Any]]:
        picks = []  # (source, row) of this epoch
        for i, (rows, quota) in enumerate(zip(self.rows, self.quotas)):
            rng, order = np.random.default_rng([seed, i]), []
            while len(order) < quota:
                order.extend(rng.permutation(len(rows)).tolist() if self.shuffle else range(len(rows)))
            picks.extend((i, r) for r in order[:quota])
        if self.shuffle:
            picks = [picks[j] for j in np.random.default_rng([seed, len(self.rows)]).permutation(len(picks))]
        for i, r in picks:
            yield dict(self.rows[i][r])  # a copy: agents may write into their sample

    def keys(self) -> set[str]:
        """Every sample's prompt as text: what an evaluation compares its held-out prompts with."""
        return {prompt_key(s) for rows in self.rows for s in rows}


def prompt_key(sample: dict) -> str:
    return json.dumps(sample["messages"], sort_keys=True, default=str)


def load(source: Source) -> list[dict[str, Any]]:
    """The samples of ``source``, every row checked (``ValueError`` naming the file, row and field)."""
    rows = _read(source)[: source.limit]  # (limit None: every row)
    if not rows:
        raise ValueError(f"data source {source.label} has no rows")
    return [_sample(source, i, row) for i, row in enumerate(rows)]


def _read(source: Source) -> list[dict]:
    if source.reasoning_gym:
        require("data", f"data source reasoning_gym: {source.reasoning_gym}", ("reasoning_gym",))
        import reasoning_gym

        try:
            data = reasoning_gym.create_dataset(source.reasoning_gym, seed=source.seed, size=source.size,
                                                **source.config)
        except Exception as e:  # unknown task, a bad config key: reasoning-gym says which
            raise ValueError(f"data source reasoning_gym:{source.reasoning_gym}: {type(e).__name__}: {e}") from None
        return [dict(entry) for entry in data]
    if source.generator:
        fn = imported(source.generator, "data source generator")
        return [dict(r) for r in fn(seed=source.seed, size=source.size, **source.config)]
    return read_file(source.path, source.split)


def read_file(path: str, split: str | None) -> list[dict]:
    import datasets

    datasets.disable_progress_bars()
    if not os.path.exists(path):
        raise ValueError(f"data source {path}: no such file or folder")
    try:
        if os.path.isdir(path):
            data = datasets.load_from_disk(path)
            if isinstance(data, datasets.DatasetDict):
                if split not in data:
                    raise _Unreadable(f"it holds the splits {list(data)}: pick one with split:")
                data = data[split]
        else:
            kind = READERS.get(os.path.splitext(path)[1].lower())
            if kind is None:
                raise _Unreadable(f"unknown file type: use one of {', '.join(READERS)} or a datasets folder")
            if kind == "json":
                _check_json_lines(path)
            data = datasets.Dataset.from_file(path) if kind == "arrow" else \
                datasets.load_dataset(kind, data_files=path, split="train")
    except _Unreadable as e:
        raise ValueError(f"data source {path}: {e}") from None
    except Exception as e:  # Arrow and parser errors
        raise ValueError(f"data source {path} could not be read: {type(e).__name__}: {e}") from None
    return data.to_list()


class _Unreadable(ValueError):
    """What ``read_file`` found wrong, said in its own words."""


def _check_json_lines(path: str) -> None:
    """A JSONL line that does not parse, named by its number (the datasets reader's error does not say where)."""
    with open(path, encoding="utf-8") as f:
        head = f.read(1).lstrip()
        f.seek(0)
        if head == "[":  # one JSON array
            return
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise _Unreadable(f"line {n} is not valid JSON ({e})") from None
                if not isinstance(row, dict):
                    raise _Unreadable(f"line {n} is a {type(row).__name__}, not a JSON object")


def _sample(source: Source, i: int, row: dict) -> dict[str, Any]:
    where = f"data source {source.label}, row {i}"
    if source.template is not None:
        try:
            content = source.template.format(**row)
        except KeyError as e:
            raise ValueError(f"{where}: the template names the field {e.args[0]!r}, which the row lacks (it has "
                             f"{_fields(row)})") from None
        except (IndexError, ValueError) as e:
            raise ValueError(f"{where}: the template does not format ({e}); write literal braces as {{{{ }}}}") \
                from None
        messages = [{"role": "user", "content": content}]
    else:
        if row.get(source.prompt) is None:  # files with a shared schema read a missing field as None
            raise ValueError(f"{where}: no field {source.prompt!r} (the row has {_fields(row)}): set prompt: to the "
                             "field that holds the prompt, or template:")
        content = row[source.prompt]
        messages = content if isinstance(content, list) else [{"role": "user", "content": content}]
    if not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError(f"{where}: field {source.prompt!r} must be a text or a list of chat messages")
    if not any(isinstance(m.get("content"), str) and m["content"].strip() for m in messages):
        raise ValueError(f"{where}: the prompt is empty (field {source.prompt or 'template'})")
    if source.system:
        messages = [{"role": "system", "content": source.system}, *messages]
    sample = {k: v for k, v in row.items() if k not in RESERVED}
    sample.update(messages=messages, verifier=source.verifier, source=source.name, row=i)
    if source.answer is not None:
        if row.get(source.answer) is None or str(row[source.answer]).strip() == "":
            raise ValueError(f"{where}: no answer in field {source.answer!r} (the row has {_fields(row)}): set "
                             "answer: to the field that holds it (or answer: null for a verifier that needs none)")
        sample["answer"] = row[source.answer]
    if source.tools is not None:
        sample["tools"] = tool_schemas(row.get(source.tools), where, source.tools)
    return sample


def json_field(value: Any, where: str, field: str) -> Any:
    """A field's value, parsed when it is JSON text (a list stored as a string)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: field {field!r} is text that is not valid JSON ({e})") from None


def tool_schemas(value: Any, where: str, field: str) -> list[dict] | None:
    """A row's tool schemas (a list, or its JSON text), checked; None for none (``molt sft`` reads them too)."""
    tools = json_field(value, where, field)
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"{where}: field {field!r} must be a list of tool schemas "
                         '({"type": "function", "function": {...}}), got ' + type(tools).__name__)
    return tools or None


def _fields(row: dict) -> list[str]:
    return sorted(k for k, v in row.items() if v is not None)
