"""A distillation teacher in the trainer vs on an engine of its own: the same result, s/step, the trainer's memory.

``--part distill`` (the result): ``recipes/distill.yaml`` for ``--steps`` steps over ``--seeds``, once with the
teacher in the trainer (``model.teacher: <folder>``) and once on a torch engine of its own
(``recipes/distill_teacher_engine.yaml``); per run the held-out avg@4 at the last evaluation, the median s/step and
the trainer process's peak RSS; then molt-bench's verdict on the held-out means (``compare-published``).

``--part memory`` (the memory): ``recipes/smollm2_chain_sum.yaml`` (its held-out rounds cut to 8 prompts x 1) with
SmolLM2-135M as its own teacher (``distill_coef`` 0.1 beside GRPO; at temperature 1.0, where a vLLM engine can score)
for a few steps: no teacher, the teacher in the trainer, and on a ``molt serve`` server (``RemoteVLLMEngine``, another
process): the trainer process's peak RSS (``wait4``'s ``ru_maxrss``: the process itself, not its children; vLLM's CPU
engine of the policy runs inside it either way) and s/step.

    python benchmarks/teacher_engine.py --part distill [--seeds 0-2] [--steps 40]
    python benchmarks/teacher_engine.py --part memory [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
from default_seeds import seeds  # "0-2" -> [0, 1, 2] (this script's folder is on the path)

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_TEACHER = ("--model.teacher.class_path=molt_lightning.engines.Auxiliary "
                   "--model.teacher.init_args.model=molt_lightning.models.smollm2.smollm2_policy "
                   "--model.teacher.init_args.name=teacher "
                   "--model.teacher.init_args.engine.class_path=molt_lightning.engines.RemoteVLLMEngine "
                   "--model.teacher.init_args.engine.init_args.cpu_threads=0").split()


def run(name: str, args: list[str]) -> dict:
    """One ``molt fit`` in a child process: its run folder's summary and the child's peak RSS."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MOLT_QUIET": "1"}
    cmd = [sys.executable, "-m", "molt_lightning.commands.cli", "fit", *args, "--trainer.logger.init_args.save_dir",
           "runs/teacher_engine", "--trainer.logger.init_args.name", name]
    with open(ROOT / "runs" / f"teacher_engine-{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    if status:
        raise SystemExit(f"{name} failed: see runs/teacher_engine-{name}.log")
    folder = max((ROOT / "runs" / "teacher_engine" / name).glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    m = pd.read_csv(folder / "metrics.csv")
    evals = [json.loads(x) for x in (folder / "eval.jsonl").read_text().splitlines()] \
        if (folder / "eval.jsonl").exists() else []
    last = evals[-1] if evals else None
    return {"run": name, "s/step": m["perf/step_time_s"].dropna().iloc[1:].median(),
            "peak RSS GiB": usage.ru_maxrss / 2**20,
            "held-out avg@4": next(iter(last["metrics"].values())).get("avg@4") if last else None,
            "at version": last["version"] if last else None,
            "reverse KL (last 5 steps)": m["distill/reverse_kl"].dropna().iloc[-5:].mean()
            if "distill/reverse_kl" in m else None,
            "teacher requests": m["teacher/requests"].sum() if "teacher/requests" in m else 0,
            "teacher failures": m["teacher/failures"].sum() if "teacher/failures" in m else 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["distill", "memory"], required=True)
    ap.add_argument("--seeds", default="0-2")
    ap.add_argument("--steps", type=int, default=None)
    a = ap.parse_args()
    (ROOT / "runs").mkdir(exist_ok=True)
    rows = []
    if a.part == "distill":
        for seed in seeds(a.seeds):
            common = ["--config", "recipes/distill.yaml", "--seed_everything", str(seed),
                      "--model.engine.init_args.seed", str(seed), "--model.rollout.task_seed", str(seed),
                      "--trainer.max_steps", str(a.steps or 40)]
            for where, extra in [("trainer", []), ("engine", ["--config", "recipes/distill_teacher_engine.yaml"])]:
                rows.append({"teacher": where, "seed": seed, **run(f"distill-{where}-{seed}", common + extra)})
                print(rows[-1], flush=True)
    else:
        import yaml

        recipe = yaml.safe_load((ROOT / "recipes" / "smollm2_chain_sum.yaml").read_text())
        for callback in recipe["trainer"]["callbacks"]:  # its held-out rounds cut to 8 prompts x 1 run
            if callback["class_path"].endswith("Evaluate"):
                callback["init_args"].update(max_prompts=8, k=1)
        (ROOT / "runs" / "teacher_engine_memory.yaml").write_text(yaml.safe_dump(recipe))
        common = ["--config", "runs/teacher_engine_memory.yaml", "--model.algo.distill_coef", "0.1",
                  "--trainer.max_steps", str(a.steps or 6), "--model.rollout.prompts_per_step", "2",
                  "--model.rollout.temperature", "1.0"]  # a vLLM engine scores at 1.0 only
        for where, extra in [("none", ["--model.algo.distill_coef", "0"]),
                             ("trainer", ["--model.teacher", "molt_lightning.models.smollm2.smollm2_policy"]),
                             ("engine", SMOLLM2_TEACHER)]:
            rows.append({"teacher": where, **run(f"memory-{where}", common + extra)})
            print(rows[-1], flush=True)
    df = pd.DataFrame(rows)
    print(df.to_markdown(index=False, floatfmt=".3f"))
    if a.part == "distill":
        stats = df.groupby("teacher")["held-out avg@4"].agg(["mean", "std", "count"])
        sides = [f"{w}={stats.loc[w, 'mean']:.4f},{stats.loc[w, 'std']:.4f},{int(stats.loc[w, 'count'])}"
                 for w in ("engine", "trainer")]
        subprocess.run([sys.executable, "-m", "molt_lightning.bench.cli", "compare-published", *sides, "--goal", "max",
                        "--margin", "0.05"], cwd=ROOT)


if __name__ == "__main__":
    main()
