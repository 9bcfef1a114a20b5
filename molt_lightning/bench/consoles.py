"""Readers for the metrics other stacks print to the console, for runs whose only record is a log file.

Written by hand: no library parses these formats. Each reader has ``importers``' signature
(``path, step_key=None -> [(label, frame)]``), picks its own lines out of a log that holds anything else (vLLM,
Ray, warnings) and ignores the rest; a line that *is* one of its lines but does not parse raises ``RunSetError``
naming the file and line number. ANSI colour codes and a container runtime's timestamp prefix are stripped first.

- verl's console logger (``verl/utils/logger/aggregate_logger.py``, ``concat_dict_to_str``): one line per step,
  ``step:N - key:value - key:value ...``, values printed with ``pprint.pformat`` (so numpy scalars may read
  ``np.float64(0.5)``); Ray may prefix ``(TaskRunner pid=...)``.
- slime: ``[time] file:line - {kind} {id}: {dict}`` with a Python dict literal, ``kind`` one of ``rollout``,
  ``perf`` (printed twice per rollout, by the rollout and the train side, with different keys), ``step`` (train)
  or ``eval``; values such as ``tensor([0.2])`` or ``np.float64(0.2)`` are read from the syntax tree (``ast``),
  never evaluated. Each dict carries its own step key (``rollout/step`` = the rollout id, ``train/step``,
  ``eval/step``), set from the printed id where missing; the id is kept as ``<kind>/id``. The critic's
  ``critic-step N:`` lines are not read.
- AReaL's ``StatsLogger``: a line ``... StatsLogger INFO: Epoch e/E Step s/S Train step g/G done.`` and, after
  it, box tables whose rows hold ``key | value`` pairs; ``step`` is ``g`` (the count of finished train steps),
  ``global_step`` is ``g - 1`` (the 0-based step AReaL gives its other loggers), and the wall time is the logger's
  own timestamp on the ``done`` line.
"""

from __future__ import annotations

import ast
import datetime as _dt
import re
from pathlib import Path

import pandas as pd

from .runs import RunSetError

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
RUNTIME_STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z\s")  # docker/k8s `--timestamps`
SCALAR_CALLS = {"tensor", "float64", "float32", "float16", "bfloat16", "int64", "int32", "float", "int", "array"}


def clean(line: str) -> str:
    return RUNTIME_STAMP.sub("", ANSI.sub("", line)).rstrip("\r\n")


def scalar(text: str) -> float | None:
    """A logged value as a float, read from Python's syntax tree (no eval): ``0.2``, ``-1e-3``, ``nan``,
    ``tensor([0.2])``, ``tensor(0.2, device='cuda:0')``, ``np.float64(0.2)``, ``float('nan')``, ``True``. Returns
    None for a value that is not one number (a string, a list of several); raises ValueError for what is not a
    Python literal of these shapes."""
    return _value(ast.parse(text.strip(), mode="eval").body)


def literal_dict(text: str) -> dict[str, float]:
    """A printed ``{'key': value, ...}`` -> the keys whose values are single numbers (see ``scalar``)."""
    node = ast.parse(text.strip(), mode="eval").body
    if not isinstance(node, ast.Dict):
        raise ValueError("not a dict literal")
    out = {}
    for k, v in zip(node.keys, node.values):
        if not (isinstance(k, ast.Constant) and isinstance(k.value, str)):
            raise ValueError(f"a key that is not a string: {ast.unparse(k) if k else '**'}")
        x = _value(v)
        if x is not None:
            out[k.value] = x
    return out


def _value(node: ast.AST) -> float | None:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, (bool, int, float)):
            return float(node.value)
        if isinstance(node.value, str):
            try:
                return float(node.value) if node.value.strip().lower() in ("nan", "inf", "-inf") else None
            except ValueError:
                return None
        return None if node.value is None else _bad(node)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        x = _value(node.operand)
        return None if x is None else (-x if isinstance(node.op, ast.USub) else x)
    if isinstance(node, ast.Name) and node.id in ("nan", "inf"):
        return float(node.id)
    if isinstance(node, (ast.List, ast.Tuple)):
        values = [_value(e) for e in node.elts]
        return values[0] if len(values) == 1 else None
    if isinstance(node, ast.Call):
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if name in SCALAR_CALLS and node.args:
            return _value(node.args[0])
    return _bad(node)


def _bad(node: ast.AST):
    raise ValueError(f"cannot read {ast.unparse(node)[:60]!r} as a number")


def _lines(path: Path):
    with open(path, encoding="utf-8", errors="replace") as f:
        for i, line in enumerate(f, 1):
            yield i, clean(line)


def _frames(path: Path, rows: list[dict], what: str, key: str = "step") -> list[tuple[str, pd.DataFrame]]:
    """Rows -> runs. A log that goes back to its first step (or before) holds a fresh launch of the job after the
    first (a relaunch appends to the same file): each launch is returned as its own run, labelled
    ``<file> [launch k]``. A step that goes back to the middle is a resume from a checkpoint: it stays in the run,
    and the later value of each repeated step wins when the run is normalised (``molt-bench check`` lists them)."""
    if not rows:
        raise RunSetError(f"{path}: no {what} found; is this the right log (or pass --format)?")
    launches: list[list[dict]] = [[]]
    for row in rows:
        first = launches[-1][0].get(key) if launches[-1] else None
        if first is not None and row.get(key) is not None and row[key] <= first:
            launches.append([])
        launches[-1].append(row)
    stem = Path(path).stem
    if len(launches) == 1:
        return [(stem, pd.DataFrame(rows))]
    return [(f"{stem} [launch {k}]", pd.DataFrame(part)) for k, part in enumerate(launches, 1)]


VERL_STEP = re.compile(r"(?:^|\s)step:(\d+) - (.*)$")


def read_verl_console(path: Path, step_key: str | None = None) -> list[tuple[str, pd.DataFrame]]:
    """verl's console lines ``step:N - key:value - ...`` (see the module docstring)."""
    rows = []
    for i, line in _lines(path):
        m = VERL_STEP.search(line)
        if not m:
            continue
        row = {"step": int(m.group(1))}
        for part in m.group(2).split(" - "):
            key, sep, value = part.partition(":")
            try:
                if not sep or not key.strip():
                    raise ValueError(f"{part[:60]!r} is not key:value")
                x = scalar(value)
            except (ValueError, SyntaxError) as e:
                raise RunSetError(f"{path}:{i}: a verl step line that does not parse: {e}") from None
            if x is not None:
                row[key.strip()] = x
        rows.append(row)
    return _frames(path, rows, "verl console lines (step:N - key:value - ...)")


SLIME_LINE = re.compile(r"(?:^|[\s\]:>|])(rollout|perf|step|eval) (\d+): (\{.*\})\s*$")
SLIME_STEP_KEYS = {"rollout": "rollout/step", "perf": "rollout/step", "step": "train/step", "eval": "eval/step"}


def read_slime_console(path: Path, step_key: str | None = None) -> list[tuple[str, pd.DataFrame]]:
    """slime's ``rollout N: {...}`` / ``perf N: {...}`` / ``step N: {...}`` / ``eval N: {...}`` lines."""
    rows = []
    for i, line in _lines(path):
        m = SLIME_LINE.search(line)
        if not m:
            continue
        kind, ident = m.group(1), int(m.group(2))
        try:
            row = literal_dict(m.group(3))
        except (ValueError, SyntaxError) as e:
            raise RunSetError(f"{path}:{i}: a slime `{kind} {ident}:` line whose dict does not parse: {e}") from None
        row.setdefault(SLIME_STEP_KEYS[kind], float(ident))
        row[f"{kind}/id"] = float(ident)
        rows.append(row)
    return _frames(path, rows, "slime console lines (rollout N: {...})", key="rollout/id")


AREAL_DONE = re.compile(r"(\d{8}-\d\d:\d\d:\d\d(?:\.\d+)?) StatsLogger INFO: Epoch (\d+)/(\d+) Step (\d+)/(\d+) "
                        r"Train step (\d+)/(\d+) done\.")
BOX = "│"


def read_areal_console(path: Path, step_key: str | None = None) -> list[tuple[str, pd.DataFrame]]:
    """AReaL's ``StatsLogger`` console tables (see the module docstring)."""
    rows: list[dict] = []
    row = None
    for i, line in _lines(path):
        m = AREAL_DONE.search(line)
        if m:
            stamp = _dt.datetime.strptime(m.group(1), "%Y%m%d-%H:%M:%S.%f" if "." in m.group(1) else "%Y%m%d-%H:%M:%S")
            row = {"step": int(m.group(6)), "global_step": int(m.group(6)) - 1, "epoch": int(m.group(2)),
                   "epoch_step": int(m.group(4)),
                   "__wall": stamp.replace(tzinfo=_dt.timezone.utc).timestamp()}
            rows.append(row)
            continue
        if BOX not in line or row is None:
            continue
        cells = [c.strip() for c in line.split(BOX)[1:-1]]
        if len(cells) % 2 or not cells:
            raise RunSetError(f"{path}:{i}: a StatsLogger table row that is not key | value pairs: {line[:80]!r}")
        for key, value in zip(cells[::2], cells[1::2]):
            if not key and not value:  # the blank cells that pad a table's last row
                continue
            try:
                row[key] = float(value)
            except ValueError:
                raise RunSetError(f"{path}:{i}: StatsLogger value {value!r} of {key!r} is not a number") from None
    return _frames(path, rows, "AReaL StatsLogger tables ('Train step g/G done.')")


READERS = {"verl-console": read_verl_console, "slime-console": read_slime_console,
           "areal-console": read_areal_console}


def guess(path: Path) -> str | None:
    """The console format whose lines appear in the first 2 MB of ``path``, or None."""
    with open(path, encoding="utf-8", errors="replace") as f:
        head = ANSI.sub("", f.read(2_000_000))
    for name, pattern in (("areal-console", AREAL_DONE), ("verl-console", VERL_STEP), ("slime-console", SLIME_LINE)):
        if any(pattern.search(line) for line in head.splitlines()):
            return name
    return None
