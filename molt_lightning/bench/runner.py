"""``molt-bench run`` and ``molt-bench import``: make a run set (see ``runs``) from a stack here or from files.

``run`` applies the stack's protocol changes (recorded), checks the stack can honour every field, then runs the
seeds one after another in this process, writing each seed's metrics and the manifest as soon as the seed ends. An
output folder that already holds the same stack and protocol is resumed (finished seeds are kept); one that holds
anything else is refused. A seed that raises is recorded as failed with its error, the others still run, and the
command then exits non-zero.

``import`` reads one file or folder per seed (or several runs from one W&B panel export), maps the source stack's
names onto the protocol's, and records the protocol the user says those runs followed (``--protocol`` plus
``--set`` for what they changed), so ``compare`` can hold them to it.
"""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path

from . import importers, runs
from .protocol import Protocol
from .stacks import get_stack


def run(protocol: Protocol, stack_name: str, n_seeds: int | None, out: Path, options: dict | None = None,
        log=print) -> Path:
    options = dict(options or {})
    stack = get_stack(stack_name)
    effective = protocol.with_changes(stack.changes)
    stack.check(effective)
    seeds = effective.seeds(n_seeds)
    out = Path(out)
    manifest = _start_manifest(out, effective, stack_name, options)
    manifest.update({"environment": runs.environment(), "stack_notes": stack.notes,
                     "stack_config": stack.describe(options), "stack_changes": stack.changes,
                     "source": {"kind": "run"}})
    failed = []
    for seed in seeds:
        done = manifest["seeds"].get(str(seed), {})
        if done.get("status") == "ok":
            log(f"[molt-bench] seed {seed}: already in {out}, kept")
            continue
        log(f"[molt-bench] {stack_name} seed {seed}: {effective.name} ({effective.data['steps']} steps)")
        t0 = time.perf_counter()
        try:
            frame = stack.run_seed(effective, seed, out / f"seed_{seed}" / "raw", options)
        except Exception as e:  # recorded, the other seeds still run
            failed.append(seed)
            manifest["seeds"][str(seed)] = {"status": "failed", "error": f"{type(e).__name__}: {e}",
                                            "traceback": traceback.format_exc(limit=8)}
            runs.write_manifest(out, manifest)
            log(f"[molt-bench] seed {seed} FAILED: {type(e).__name__}: {e}")
            continue
        wall = time.perf_counter() - t0
        rel = runs.write_seed(out, seed, frame)
        manifest["seeds"][str(seed)] = {"status": "ok", "metrics": rel, "wall_time_s": round(wall, 2),
                                        "steps": int(len(frame)), "raw": f"seed_{seed}/raw"}
        runs.write_manifest(out, manifest)
        log(f"[molt-bench] seed {seed}: {len(frame)} steps in {wall:.1f} s")
    if failed:
        raise RuntimeError(f"seeds {failed} failed (errors in {out / runs.MANIFEST}); the others are in {out}")
    return out


def import_runs(sources: list[Path], protocol: Protocol, stack: str, out: Path, fmt: str | None = None,
                maps: list[str] | None = None, seeds: list[int] | None = None, step_key: str | None = None,
                devices: int = 1, label: str | None = None) -> Path:
    spec = importers.column_map(stack, maps)
    found = [(src, name, frame) for src in sources for name, frame in importers.read(Path(src), fmt, step_key)]
    if seeds is None:
        seeds = list(range(len(found)))
    if len(seeds) != len(found):
        raise runs.RunSetError(f"{len(found)} runs found in {[str(s) for s in sources]} but {len(seeds)} seeds given; "
                         "pass one --seed-ids value per run")
    out = Path(out)
    manifest = _start_manifest(out, protocol, stack, {"devices": devices}, fresh=True)
    here = runs.environment(probe_accelerator=False)  # where the import ran, not the runs
    manifest.update({"environment": {"imported_on": here}, "label": label, "source": {
        "kind": "import", "format": fmt or "auto", "source_stack": stack, "column_map": spec["columns"],
        "step_base": spec["step_base"], "devices": devices, "files": [str(s) for s in sources]}})
    for seed, (src, name, raw) in zip(seeds, found):
        raw = importers.step_rows(raw, spec)
        columns = importers.resolve_columns(spec["columns"], raw)
        frame = runs.normalise(raw, columns, protocol.samples_per_step, spec["step_base"],
                               devices=devices, per_device=spec["per_device"])
        missing = [m for m in protocol.metrics if m not in frame]
        rel = runs.write_seed(out, seed, frame)
        if "step_time_s" not in columns and "step_time_s" in frame:
            columns["step_time_s"] = "(wall clock between logged steps)"
        part = name[len(Path(src).stem):].strip() if name.startswith(Path(src).stem) else f"[{name}]"
        manifest["seeds"][str(seed)] = {"status": "ok", "metrics": rel, "steps": int(len(frame)),
                                        "imported_from": f"{src} {part}".strip(),
                                        "columns_used": columns, "missing_metrics": missing,
                                        "repeated_steps": runs.repeated_steps(raw, columns.get("step", "step"))}
    runs.write_manifest(out, manifest)
    return out


def _start_manifest(out: Path, protocol: Protocol, stack: str, options: dict, fresh: bool = False) -> dict:
    """The manifest less its environment (the caller adds that once this has not refused); the seeds of a run set
    ``out`` already holds with the same stack and protocol are kept, unless ``fresh`` (import) refuses any."""
    manifest = {"molt_bench": 1, "stack": stack, "options": options, "protocol_name": protocol.name,
                "protocol_file": protocol.source, "protocol": protocol.data, "fingerprint": protocol.fingerprint,
                "seeds": {}}
    existing = out / runs.MANIFEST
    if existing.exists():
        old = json.loads(existing.read_text())
        same = old.get("fingerprint") == protocol.fingerprint and old.get("stack") == stack
        if fresh or not same:
            why = "import always writes a new run set" if fresh else (
                f"it holds stack {old.get('stack')} on protocol {old.get('protocol_name')}@{old.get('fingerprint')}")
            raise FileExistsError(f"{out} already holds a run set and {why}; choose another --out or delete it")
        manifest["seeds"] = old.get("seeds", {})
    return manifest
