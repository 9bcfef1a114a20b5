"""Importers for runs made elsewhere: the files other stacks really write, read into one shape.

Each reader returns ``[(label, frame)]``: a frame with a ``step`` column, the logged columns under their own names,
and ``__wall`` (seconds since the epoch) when the format records wall time. A file may hold several runs (a W&B
panel export has one column group per run; a console log may hold a relaunch), hence the list. ``STACK_COLUMNS``
then maps each source stack's names to the protocol's metric names, and ``runs.normalise`` makes the run-set frame.

Formats: Lightning's CSV, JSONL (verl's ``file`` logger writes ``{"step": N, "data": {...}}``; the ``data`` object
is unwrapped), TensorBoard event files, W&B CSV exports, NeMo-RL's ``metrics.json`` (``{tag: {step: value}}``), and
the console logs of verl, slime and AReaL (``consoles``). Tried on the real files in ``../shared/real-logs/``
(``tests/bench/test_bench_real_logs.py``).

Where the names come from (checked against each project's logging code; a column entry may list candidates, the
first one the file has is used and recorded in the manifest):
- molt: ``AsyncRLModule.training_step`` and ``RolloutMonitor`` (``reward``, ``perf/step_time_s``,
  ``perf/gen_tokens_per_s``, ``batch/samples``); Lightning's CSV ``step`` starts at 0.
- trl: ``GRPOTrainer`` log history (``reward``, ``step_time``; ``step`` is ``state.global_step``, from 1); through
  W&B the same names carry a ``train/`` prefix. TRL logs no throughput; ``molt-bench run --stack trl`` adds
  ``bench/gen_tokens_per_s`` and ``bench/step_time_s`` (wall between step ends, as molt measures it).
- slime (Megatron backend): ``rollout/raw_reward``, ``perf/step_time``, ``perf/tokens_per_gpu_per_sec`` (already
  per GPU), step key ``rollout/step`` from 0.
- NeMo-RL (Megatron or DTensor backend): ``train/reward``, ``timing/train/total_step_time``,
  ``performance/generation_tokens_per_sec_per_gpu``; steps from 1.
- verl: ``critic/score/mean`` (else ``critic/rewards/mean``, which adds the in-reward KL penalty when that is on),
  ``timing_s/step``, ``perf/throughput`` (tokens per second per GPU, counting prompt and response tokens: not the
  same quantity as generated tokens; say so when comparing it); steps from 1.
- AReaL: ``ppo_actor/task_reward/avg`` (``grpo_actor/`` in older versions; else ``rollout/reward``, which is
  missing from steps where no rollout finished), step ``global_step`` from 0; no step time or throughput in one
  number (the console reader's wall clock gives the step time).
- ROLL: ``critic/score/mean``, ``time/step_total``, ``system/tps_gpu``, step ``system/global_step`` from 0.
  ROLL logs the *previous* step's duration as ``time/step_total`` (0 at the first step): its step times lag by one.
- labs-molt (NVIDIA-NeMo/labs-molt, derived from OpenRLHF): ``train/rollout/reward_mean``,
  ``train/timing/step_total``, step from 1 (TensorBoard's own step, or ``train/global_step``). Its
  ``perf/train_tokens_per_sec`` counts trained tokens, not generated ones, so it is not mapped.
- OpenRLHF: ``train/rollout/reward_mean`` (older: ``train/reward``), ``train/timing/step_total`` (the sum of its
  other timings), step from 1; no throughput.
- tinker-cookbook (``rl.train``, 0.6.1): its ``log_path/metrics.jsonl`` (``utils/ml_log.py``), one row per step
  from 0 (``step`` = the batch index); ``env/all/reward/total`` (``rl/metric_util.py``: the mean over the batch's
  trajectories of their summed rewards), ``time/total`` (``utils/trace.py``: the wall time of the step's
  ``trace_iteration``: sampling, the train step, the next sampler's weights). No throughput in one number;
  ``molt-bench run --stack tinker-cookbook`` adds ``bench/gen_tokens_per_s`` (``env/all/total_ac_tokens`` /
  ``time/total``). After the last step it logs a row of token totals (and of final evaluations, if any) at step
  = the number of steps: not a training step, so only rows holding ``time/total`` are read (``step_rows``).
No real ROLL, labs-molt or OpenRLHF file was found to try these maps on; they come from the logging code.
Any entry can be replaced with ``--map name=COLUMN``.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd

from . import consoles
from .runs import RunSetError

STACK_COLUMNS: dict[str, dict] = {
    "molt": {"columns": {"step": "step", "reward": "reward", "step_time_s": "perf/step_time_s",
                         "tokens_per_s_per_device": "perf/gen_tokens_per_s", "samples_per_step": "batch/samples",
                         "duplicates": "samples/duplicates"},
             "step_base": 0, "per_device": ("tokens_per_s_per_device",)},
    "trl": {"columns": {"step": "step", "reward": "reward", "step_time_s": "bench/step_time_s",
                        "tokens_per_s_per_device": "bench/gen_tokens_per_s"},
            "step_base": 1, "per_device": ("tokens_per_s_per_device",)},
    "tinker-cookbook": {"columns": {"step": "step", "reward": "env/all/reward/total", "step_time_s": "time/total"},
                        "step_base": 0, "per_device": (), "step_rows": "time/total"},
    "trl-wandb": {"columns": {"step": "train/global_step", "reward": "train/reward", "step_time_s": "train/step_time"},
                  "step_base": 1, "per_device": ()},
    "slime": {"columns": {"step": "rollout/step", "reward": "rollout/raw_reward", "step_time_s": "perf/step_time",
                          "tokens_per_s_per_device": "perf/tokens_per_gpu_per_sec"},
              "step_base": 0, "per_device": ()},
    "nemo-rl": {"columns": {"step": "step", "reward": "train/reward", "step_time_s": "timing/train/total_step_time",
                            "tokens_per_s_per_device": "performance/generation_tokens_per_sec_per_gpu"},
                "step_base": 1, "per_device": ()},
    "verl": {"columns": {"step": "step", "reward": ("critic/score/mean", "critic/rewards/mean"),
                         "step_time_s": ("timing_s/step", "perf/time_per_step"),
                         "tokens_per_s_per_device": "perf/throughput"},
             "step_base": 1, "per_device": ()},
    "areal": {"columns": {"step": "global_step", "reward": ("ppo_actor/task_reward/avg", "grpo_actor/task_reward/avg",
                                                            "rollout/reward")},
              "step_base": 0, "per_device": ()},
    "roll": {"columns": {"step": "system/global_step", "reward": "critic/score/mean", "step_time_s": "time/step_total",
                         "tokens_per_s_per_device": "system/tps_gpu"},
             "step_base": 0, "per_device": ()},
    "labs-molt": {"columns": {"step": "train/global_step", "reward": "train/rollout/reward_mean",
                              "step_time_s": "train/timing/step_total"},
                  "step_base": 1, "per_device": ()},
    "openrlhf": {"columns": {"step": "train/global_step", "reward": ("train/rollout/reward_mean", "train/reward"),
                             "step_time_s": "train/timing/step_total"},
                 "step_base": 1, "per_device": ()},
}
STEP_CANDIDATES = ("step", "_step", "global_step", "Step", "train/global_step", "trainer/global_step", "iteration")
WALL_CANDIDATES = ("_timestamp", "timestamp", "time", "wall_time")


def read_lightning_csv(path: Path, step_key: str | None = None) -> list[tuple[str, pd.DataFrame]]:
    """``CSVLogger``'s ``metrics.csv`` (a ``lightning_logs/version_N`` folder or the file itself). ``step_key`` is
    accepted like every reader's and unused: the step is Lightning's own ``step`` column."""
    path = Path(path)
    if path.is_dir():
        found = sorted(path.rglob("metrics.csv"))
        if not found:
            raise RunSetError(f"{path}: no metrics.csv below it (a Lightning CSVLogger writes "
                              "lightning_logs/version_N/metrics.csv)")
        path = found[-1]
    df = pd.read_csv(path)
    if "step" not in df:
        raise RunSetError(f"{path}: no 'step' column; is this a Lightning CSVLogger file?")
    return [(path.parent.name, df)]


def read_jsonl(path: Path, step_key: str | None = None) -> list[tuple[str, pd.DataFrame]]:
    """One JSON object per line; nested objects are flattened with '/' (``{"a": {"b": 1}}`` -> column ``a/b``).
    verl's file logger rows ``{"step": N, "data": {...}}`` are unwrapped (``data``'s keys are already full names)."""
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise RunSetError(f"{path}:{i}: not JSON ({e}); a JSONL file has one object per line") from e
            if isinstance(obj, dict):
                if set(obj) == {"step", "data"} and isinstance(obj["data"], dict):
                    obj = {"step": obj["step"], **obj["data"]}
                rows.append(_flat(obj))
    df = pd.DataFrame(rows)
    return [(Path(path).stem, _with_step(df, path, step_key))]


def read_tensorboard(path: Path, step_key: str | None = None) -> list[tuple[str, pd.DataFrame]]:
    """Scalars from TensorBoard event files (a file or a folder of them), read with tensorboard's own reader."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as e:
        raise RunSetError("reading TensorBoard files needs the tensorboard package: pip install tensorboard") from e
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags().get("scalars", [])
    if not tags:
        raise RunSetError(f"{path}: no scalar summaries found in TensorBoard event files")
    series, wall = {}, {}
    for tag in tags:
        for ev in acc.Scalars(tag):
            series.setdefault(tag, {})[ev.step] = ev.value
            wall[ev.step] = max(wall.get(ev.step, 0.0), ev.wall_time)
    df = pd.DataFrame(series).sort_index()
    df.index.name = "step"
    df = df.reset_index()
    df["__wall"] = df["step"].map(wall)
    return [(Path(path).name, df)]


def read_nemo_rl_json(path: Path, step_key: str | None = None) -> list[tuple[str, pd.DataFrame]]:
    """NeMo-RL's ``metrics.json``, ``{tag: {step: value}}`` (its test suites dump the TensorBoard scalars so).
    Tags under ``ray/`` are left out: NeMo-RL's Ray resource monitor logs them against its own counter
    (``ray/ray/ray_step`` runs 0..1108 in a 30-step run), not the training step."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise RunSetError(f"{path}:{e.lineno}: not JSON ({e.msg})") from e
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise RunSetError(f"{path}: expected NeMo-RL's metrics JSON, {{tag: {{step: value}}}}")
    series = {}
    for tag, points in data.items():
        if tag.startswith("ray/"):
            continue
        try:
            series[tag] = {int(k): np.nan if v is None else float(v) for k, v in points.items()}
        except (TypeError, ValueError) as e:
            raise RunSetError(f"{path}: tag {tag!r}: steps must be integers and values numbers ({e})") from None
    df = pd.DataFrame(series).sort_index()
    df.index.name = "step"
    return [(Path(path).stem, df.reset_index())]


def read_wandb_csv(path: Path, step_key: str | None = None) -> list[tuple[str, pd.DataFrame]]:
    """A W&B CSV export: either a run's history (``_step``, ``_runtime``, metric columns) or a panel export
    (``Step`` and ``<run name> - <metric>`` columns, with ``__MIN``/``__MAX`` companions that are dropped)."""
    df = pd.read_csv(path)
    panel = [c for c in df.columns if " - " in c and not re.search(r"__(MIN|MAX)$", c)]
    if not panel:
        if "_timestamp" in df:
            df["__wall"] = df["_timestamp"]
        return [(Path(path).stem, _with_step(df, path, step_key))]
    step = step_key or next((c for c in ("Step", "_step", "step") if c in df), None)
    if step is None:
        raise RunSetError(f"{path}: a W&B panel export needs a 'Step' column")
    runs: dict[str, dict[str, pd.Series]] = {}
    for col in panel:
        run, _, metric = col.partition(" - ")
        runs.setdefault(run.strip(), {})[metric.strip()] = df[col]
    return [(run, pd.DataFrame({"step": df[step], **cols})) for run, cols in runs.items()]


READERS = {"lightning-csv": read_lightning_csv, "jsonl": read_jsonl, "tensorboard": read_tensorboard,
           "wandb-csv": read_wandb_csv, "nemo-rl-json": read_nemo_rl_json, **consoles.READERS}


def guess_format(path: Path) -> str:
    path = Path(path)
    if path.is_dir():
        if any(path.rglob("events.out.tfevents.*")):
            return "tensorboard"
        if any(path.rglob("metrics.csv")):
            return "lightning-csv"
    name = path.name
    if name.startswith("events.out.tfevents"):
        return "tensorboard"
    if name.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    if name.endswith(".csv"):
        with open(path, newline="") as f:
            header = next(csv.reader(f), [])
        if "step" in header and "_step" not in header and not any(" - " in h for h in header):
            return "lightning-csv"
        return "wandb-csv"
    if name.endswith(".json"):
        return "nemo-rl-json"
    if path.is_file() and (found := consoles.guess(path)):
        return found
    raise RunSetError(f"cannot tell the format of {path}: pass --format one of {sorted(READERS)}")


def read(path: Path, fmt: str | None = None, step_key: str | None = None) -> list[tuple[str, pd.DataFrame]]:
    if not Path(path).exists():
        raise RunSetError(f"{path}: no such file or folder")
    fmt = fmt or guess_format(path)
    if fmt not in READERS:
        raise RunSetError(f"unknown format {fmt!r}: use one of {sorted(READERS)}")
    return READERS[fmt](path, step_key)


def column_map(stack: str, overrides: list[str] | None = None) -> dict:
    """The named stack's map with ``name=COLUMN`` overrides applied (``custom`` starts from an empty map)."""
    if stack != "custom" and stack not in STACK_COLUMNS:
        raise RunSetError(f"unknown source stack {stack!r}: use one of {sorted(STACK_COLUMNS)} or 'custom' with --map")
    spec = STACK_COLUMNS.get(stack, {"columns": {}, "step_base": 0, "per_device": ()})
    spec = {**spec, "columns": dict(spec["columns"])}
    for item in overrides or []:
        name, sep, col = item.partition("=")
        if not sep or not name or not col:
            raise RunSetError(f"--map {item!r}: expected NAME=COLUMN, e.g. --map reward=train/reward")
        if name == "step_base":
            spec["step_base"] = int(col)
        else:
            spec["columns"][name] = col
    return spec


def step_rows(raw: pd.DataFrame, spec: dict) -> pd.DataFrame:
    """The rows that are training steps: those holding ``spec["step_rows"]`` when the map names such a column and the
    file has it (a stack that logs other rows against step numbers, e.g. the cookbook's final totals), else all."""
    column = spec.get("step_rows")
    return raw[raw[column].notna()] if column and column in raw else raw


def resolve_columns(columns: dict, frame: pd.DataFrame) -> dict[str, str]:
    """A map whose entries may list candidate columns -> one column per name: the first candidate ``frame`` has
    (or the first candidate, so that a missing metric is reported under the name the stack normally uses)."""
    out = {}
    for name, src in columns.items():
        candidates = (src,) if isinstance(src, str) else tuple(src)
        out[name] = next((c for c in candidates if c in frame), candidates[0])
    return out


def _flat(obj: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in obj.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _with_step(df: pd.DataFrame, path, step_key: str | None) -> pd.DataFrame:
    key = step_key or next((c for c in STEP_CANDIDATES if c in df), None)
    if key is None or key not in df:
        raise RunSetError(f"{path}: no step column among {STEP_CANDIDATES}; name it with --step-key")
    wall = next((c for c in WALL_CANDIDATES if c in df), None)
    if wall and "__wall" not in df and pd.api.types.is_numeric_dtype(df[wall]):
        df["__wall"] = df[wall]
    if key != "step":
        df = df.drop(columns=["step"], errors="ignore").rename(columns={key: "step"})
    return df
