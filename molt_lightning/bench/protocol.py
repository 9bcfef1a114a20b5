"""Protocols: the YAML files that say what two stacks must share, their fingerprint, and the mismatch check.

A protocol (``protocols/*.yaml``) names the model, task and agent, sampling parameters, optimizer, algorithm, batch
shape (prompts per step x samples per prompt), max lag, steps, seeds and the metrics with their goal, summary and
equivalence margin. Everything but ``name``/``description``/``notes`` is *matched*: it enters the fingerprint (the
first 16 hex digits of the SHA-256 of the canonical JSON of the matched fields).

A run records the protocol it actually ran (the file plus ``--set`` overrides plus what its stack changes, e.g.
molt-sync's ``max_lag: 0``), so two runs are comparable exactly when their recorded protocols are equal, field by
field; ``check_matched`` refuses otherwise and names each differing field, unless ``allow`` lists it (a prefix
such as ``optimizer`` allows every ``optimizer.*`` field).

Deviation from a "lock file" design: seeds are matched as the protocol's seed *list*; a run of the first N seeds
still follows the protocol, and the seeds it ran are recorded beside it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

UNMATCHED = ("name", "description", "notes")
REQUIRED = ("model", "task", "sampling", "optimizer", "algorithm", "batch", "max_lag", "steps", "seeds", "metrics")
SUMMARIES = ("final", "mean", "auc")
PROTOCOL_DIR = Path(__file__).resolve().parents[2] / "protocols"


class ProtocolError(ValueError):
    """A protocol file is malformed, or two runs' protocols differ."""


@dataclass
class MetricSpec:
    name: str
    goal: str = "max"  # max | min
    summary: str = "final"  # final (mean of the last `last_k` steps) | mean (after `warmup`) | auc
    last_k: int = 5
    warmup: int = 0
    margin: float | None = None  # absolute equivalence margin
    margin_rel: float | None = None  # margin as a fraction of side B's mean ("10%")
    threshold: float | None = None

    def margin_for(self, reference_mean: float) -> float:
        if self.margin is not None:
            return self.margin
        if self.margin_rel is not None:
            return self.margin_rel * abs(reference_mean)
        raise ProtocolError(f"metric {self.name!r} has no margin: give it `margin:` in the protocol or pass --margin")


def parse_margin(value: Any) -> tuple[float | None, float | None]:
    """``0.05`` -> absolute 0.05; ``"10%"`` -> relative 0.10."""
    if value is None:
        return None, None
    if isinstance(value, str) and value.strip().endswith("%"):
        return None, float(value.strip()[:-1]) / 100
    try:
        return float(value), None
    except (TypeError, ValueError):
        raise ProtocolError(f"margin {value!r} is neither a number nor a percentage such as '10%'") from None


def metric_spec(name: str, raw: dict) -> MetricSpec:
    raw = dict(raw or {})
    unknown = set(raw) - {"goal", "summary", "last_k", "warmup", "margin", "threshold"}
    if unknown:
        raise ProtocolError(f"metric {name!r}: unknown keys {sorted(unknown)}")
    margin, margin_rel = parse_margin(raw.pop("margin", None))
    spec = MetricSpec(name=name, margin=margin, margin_rel=margin_rel, **raw)
    if spec.goal not in ("max", "min"):
        raise ProtocolError(f"metric {name!r}: goal must be max or min, got {spec.goal!r}")
    if spec.summary not in SUMMARIES:
        raise ProtocolError(f"metric {name!r}: summary must be one of {SUMMARIES}, got {spec.summary!r}")
    return spec


_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")


def _numbers(node: Any) -> Any:
    """YAML 1.1 reads ``3e-4`` (no dot) as a string; make it the number it means, so fingerprints agree."""
    if isinstance(node, dict):
        return {k: _numbers(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_numbers(v) for v in node]
    if isinstance(node, str) and _NUMBER.match(node.strip()):
        return float(node)
    return node


class Protocol:
    def __init__(self, data: dict, source: str = "<dict>"):
        data = _numbers(data)
        missing = [k for k in REQUIRED if k not in data]
        if missing:
            raise ProtocolError(f"protocol {source} lacks {missing}; see protocols/arithmetic-tiny.yaml for the fields")
        self.data, self.source = data, source
        self.metrics = {name: metric_spec(name, raw) for name, raw in (data["metrics"] or {}).items()}
        if not isinstance(data["seeds"], list) or not data["seeds"]:
            raise ProtocolError(f"protocol {source}: seeds must be a non-empty list of integers")

    @property
    def name(self) -> str:
        return str(self.data.get("name", Path(self.source).stem))

    def matched(self) -> dict:
        return _m(self.data)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.matched())

    @property
    def samples_per_step(self) -> int:
        b = self.data["batch"]
        return int(b["prompts_per_step"]) * int(b["samples_per_prompt"])

    def get(self, dotted: str) -> Any:
        node = self.data
        for part in dotted.split("."):
            node = node[part]
        return node

    def with_changes(self, changes: dict[str, Any]) -> Protocol:
        data = copy.deepcopy(self.data)
        for dotted, value in changes.items():
            _set(data, dotted, value)
        return Protocol(data, self.source)

    def seeds(self, n: int | None) -> list[int]:
        seeds = [int(s) for s in self.data["seeds"]]
        if n is None:
            return seeds
        if n < 1 or n > len(seeds):
            raise ProtocolError(f"--seeds {n}: protocol {self.name} lists {len(seeds)} seeds; ask for 1..{len(seeds)} "
                                "or add seeds to the protocol's `seeds:` list")
        return seeds[:n]


def fingerprint(matched: dict) -> str:
    canonical = json.dumps(matched, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def load_protocol(ref: str | Path, overrides: list[str] | None = None) -> Protocol:
    """A protocol by path, or by name from the repository's ``protocols/`` folder, with ``key.path=value`` changes."""
    path = Path(ref)
    if not path.exists():
        named = PROTOCOL_DIR / f"{ref}.yaml"
        if named.exists():
            path = named
        else:
            known = sorted(p.stem for p in PROTOCOL_DIR.glob("*.yaml")) if PROTOCOL_DIR.exists() else []
            raise ProtocolError(f"no protocol {str(ref)!r}: give a YAML path or one of {known}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ProtocolError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ProtocolError(f"{path}: a protocol is a YAML mapping")
    protocol = Protocol(data, str(path))
    return protocol.with_changes(parse_overrides(overrides or []))


def parse_overrides(items: list[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][\w.\-/]*", key):
            raise ProtocolError(f"--set {item!r}: expected key.path=value, e.g. --set steps=30")
        out[key] = yaml.safe_load(value)
    return out


def _set(data: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            raise ProtocolError(f"cannot set {dotted!r}: {part!r} is not a section of the protocol")
        node = node[part]
    node[parts[-1]] = value


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out = {}
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out if out else {prefix[:-1]: {}}
    return {prefix[:-1]: d}


def diff(a: dict, b: dict) -> list[tuple[str, Any, Any]]:
    """Matched fields whose values differ: (dotted path, value in a, value in b); missing is ``<absent>``."""
    fa, fb = flatten(_m(a)), flatten(_m(b))
    return [(k, fa.get(k, "<absent>"), fb.get(k, "<absent>")) for k in sorted(set(fa) | set(fb))
            if fa.get(k, "<absent>") != fb.get(k, "<absent>")]


def check_matched(a: dict, b: dict, allow: list[str] | tuple = (), names: tuple[str, str] = ("A", "B")):
    """Raise ``ProtocolError`` naming every differing field not covered by ``allow``; return the allowed ones."""
    differences = diff(a, b)
    allowed = [d for d in differences if any(d[0] == p or d[0].startswith(p + ".") for p in allow)]
    refused = [d for d in differences if d not in allowed]
    if refused:
        lines = "\n".join(f"  {k}: {names[0]}={va!r}  {names[1]}={vb!r}" for k, va, vb in refused)
        flags = " ".join(f"--allow-diff {k}" for k, _, _ in refused)
        raise ProtocolError(
            f"the runs follow different protocols (fingerprints {fingerprint(_m(a))} vs {fingerprint(_m(b))}); "
            f"these fields differ:\n{lines}\nA comparison across them is not matched. If the difference is what you "
            f"mean to compare, say so: {flags}"
        )
    return allowed


def _m(d: dict) -> dict:
    return {k: v for k, v in d.items() if k not in UNMATCHED}
