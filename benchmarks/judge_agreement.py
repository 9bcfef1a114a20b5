"""How often a judge model agrees with the exact grader: SmolLM2-135M-Instruct grading its own chain-sum answers.

The policy (SmolLM2-135M-Instruct, the pretrained start of ``recipes/smollm2_chain_sum.yaml``) answers the first
``--n`` held-out problems of that recipe (``Evaluate``'s set: reasoning-gym chain_sum, seed 1000000) at the recipe's
temperature 0.7; each answer is graded by the recipe's rule (``last_number``: the last number equals the answer) and
by a ``data.judge.Judge`` on an ``engines.Auxiliary`` (the same model, frozen, on a torch engine of its own), given
the question, the answer and the reference. Per verdict shape: both correct, both wrong, judge-only-correct
(the judge passes a wrong answer), exact-only-correct (the judge fails a right one), judge failures by kind, the
agreement over the judged answers, Cohen's kappa (``statsmodels``' ``cohens_kappa``) and the judge's seconds per
answer.

``--cost N``: instead, the judge's cost per step: ``recipes/smollm2_chain_sum.yaml`` (the rule) and
``recipes/smollm2_chain_sum_judge.yaml`` (the judge on a torch engine in the trainer's process) for N steps each,
their held-out evaluation cut to 8 prompts x 1 run: the median s/step, the judge's requests and mean latency, failed
samples.

    python benchmarks/judge_agreement.py [--n 200] [--verdicts yes_no score:0-10] [--template TEXT]
    python benchmarks/judge_agreement.py --cost 10
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter

import pandas as pd


def held_out(n: int) -> list[dict]:
    from molt_lightning.data import Source, Tasks

    tasks = Tasks([Source(reasoning_gym="chain_sum", size=600, seed=1000000, verifier="last_number",
                          config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2})], shuffle=False)
    stream = tasks(0)
    return [next(stream) for _ in range(n)]


def answers(samples: list[dict], folder: str, max_tokens: int = 48) -> list[str]:
    """The policy's replies, sampled at temperature 0.7 (one seeded request each) on a torch engine."""
    from transformers import AutoTokenizer

    from molt_lightning.engines import Sampling, TorchEngine

    tok, engine = AutoTokenizer.from_pretrained(folder), TorchEngine(seed=0)
    engine.launch(folder)
    try:
        async def one(i: int, sample: dict) -> str:
            ids = tok.apply_chat_template(sample["messages"], add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            out = await engine.generate(ids, Sampling(max_tokens=max_tokens, temperature=0.7, seed=i))
            return tok.decode(out.token_ids, skip_special_tokens=True)

        async def every():
            return await asyncio.gather(*[one(i, s) for i, s in enumerate(samples)])

        return engine.call(every())
    finally:
        engine.release()


def cost(steps: int) -> None:
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    import yaml

    root, rows = Path(__file__).resolve().parents[1], []
    for name in ("smollm2_chain_sum", "smollm2_chain_sum_judge"):
        recipe = yaml.safe_load((root / "recipes" / f"{name}.yaml").read_text())
        recipe["trainer"].update(max_steps=steps, enable_progress_bar=False)
        for callback in recipe["trainer"]["callbacks"]:
            if callback["class_path"].endswith("Evaluate"):
                callback["init_args"].update(max_prompts=8, k=1)
        with tempfile.TemporaryDirectory() as tmp:
            recipe["trainer"]["logger"]["init_args"]["save_dir"] = tmp
            (Path(tmp) / "recipe.yaml").write_text(yaml.safe_dump(recipe))
            done = subprocess.run([sys.executable, "-m", "molt_lightning.commands.cli", "fit", "--config",
                                   f"{tmp}/recipe.yaml"], cwd=root, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                                  capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(done.stderr[-3000:])
            m = pd.read_csv(next(Path(tmp, name).iterdir()) / "metrics.csv")
        rows.append({"recipe": name, "steps": steps, "s/step (median, steps 1+)":
                     m["perf/step_time_s"].dropna().iloc[1:].median(),
                     "judge requests/step": m["judge/requests"].mean() if "judge/requests" in m else 0,
                     "judge latency s": m["judge/latency_s"].replace(0, float("nan")).mean()
                     if "judge/latency_s" in m else None,
                     "failed samples": m["samples/failed"].sum(), "reward": m["reward"].dropna().mean()})
        print(rows[-1], flush=True)
    print(pd.DataFrame(rows).to_markdown(index=False, floatfmt=".3f"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--verdicts", nargs="+", default=["yes_no", "score:0-10"])
    ap.add_argument("--cost", type=int, default=None, metavar="STEPS")
    ap.add_argument("--template", default=None, help="the judge's template (default: its reference rubric)")
    a = ap.parse_args()
    if a.cost:
        return cost(a.cost)
    from statsmodels.stats.inter_rater import cohens_kappa

    from molt_lightning.data.graders import run as grade
    from molt_lightning.data.judge import Judge, JudgeFailed
    from molt_lightning.engines import Auxiliary, TorchEngine
    from molt_lightning.models.smollm2 import smollm2_policy

    folder = smollm2_policy()
    samples = held_out(a.n)
    t0 = time.perf_counter()
    replies = answers(samples, folder)
    print(f"{a.n} answers in {time.perf_counter() - t0:.1f} s", flush=True)
    exact = [grade("last_number", r, s).score == 1.0 for r, s in zip(replies, samples)]
    rows = []
    for verdict in a.verdicts:
        aux = Auxiliary(folder, TorchEngine(seed=0), name="judge")
        judge = Judge(model=aux, verdict=verdict, max_tokens=24, timeout_s=600, template=a.template)

        async def judged(reply: str, sample: dict):
            try:
                return (await judge.grade(sample["messages"][-1]["content"], reply, str(sample["answer"]))).score
            except JudgeFailed as e:
                return e.kind

        async def every():
            return await asyncio.gather(*[judged(r, s) for r, s in zip(replies, samples)])

        t0 = time.perf_counter()
        try:
            verdicts = asyncio.run(every())
        finally:
            aux.stop()
        seconds = time.perf_counter() - t0
        failed = Counter(v for v in verdicts if isinstance(v, str))
        pairs = [(e, v >= 0.5) for e, v in zip(exact, verdicts) if not isinstance(v, str)]
        rows.append({
            "verdict": verdict, "template": "own" if a.template else "built-in", "answers": a.n,
            "exact correct": sum(exact),
            "both correct": sum(e and j for e, j in pairs), "both wrong": sum(not e and not j for e, j in pairs),
            "judge-only correct": sum(j and not e for e, j in pairs),
            "exact-only correct": sum(e and not j for e, j in pairs),
            "judge failures": ", ".join(f"{n} {k}" for k, n in failed.most_common()) or "0",
            "agreement": sum(e == j for e, j in pairs) / max(len(pairs), 1),
            "kappa": cohens_kappa([[sum(e == x and j == y for e, j in pairs) for y in (True, False)]
                                   for x in (True, False)]).kappa if pairs else float("nan"),
            "judge s/answer": seconds / a.n})
        print(rows[-1], flush=True)
    print(pd.DataFrame(rows).to_markdown(index=False, floatfmt=".3f"))


if __name__ == "__main__":
    main()
