"""Held-out evaluation: k agent runs per prompt on the rollout engine, and what they score, per source.

``run_round`` runs the agent ``k`` times on every held-out sample, on the engine's event loop beside the training
rollouts (at most ``concurrency`` runs at once), at the evaluation's own temperature (0: greedy), with per-request
seeds of its own. Nothing it generates is trained on. Each run becomes an ``Outcome``: its reward, whether it counts
as correct (``reward >= success``), the answer the agent read from the reply (``AgentResult.info["answer"]``, e.g.
``agents.Answer``'s), and the policy versions of its tokens. A run that fails (the agent raised, timed out, the verifier
failed) scores 0 and is counted as ``failed``.

``summarize`` turns a round into metrics per source (the sample's ``source``, else ``heldout``; ``table`` prints them,
``report`` in one line per source):
- ``avg@k``: the mean reward (over prompts of the mean over their k runs);
- ``pass@1`` and ``pass@k``: the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on
  Code", eq. 1 in its numerically stable product form), averaged over prompts;
- ``maj@k``: the share of prompts whose most frequent answer (ties: the first seen) is a correct one, when the agent
  reports answers;
- each with a 95% interval: the mean of the per-prompt values +- t(0.975, n-1) * SD / sqrt(n), the prompt being the
  unit (a central-limit interval over clustered samples, as in Miller 2024, "Adding Error Bars to Evals"); with every
  prompt scoring the same it collapses to a point, which says more about the prompt count than about certainty. The
  interval is cut to [0, 1] for pass@j and maj@k (shares: near 1 the normal interval ran to 1.013), and for avg@k
  when every reward of the round lies in [0, 1] (the shipped verifiers' range): the true value lies in [0, 1], so the
  cut only drops values it cannot take, and the coverage stays what it was;
- ``version_min`` / ``version_max``: the policy versions that sampled the round's tokens. Weights change during a
  round that runs beside training (in-flight updates), so a periodic round measures the versions it names, not one.

Written by hand: the estimator and the interval are a few lines each (scipy gives the t quantile); no maintained
library computes pass@k from per-prompt counts without pulling in a whole evaluation harness.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from ..agents.sessions import AgentSessions
from ..trajectory import Trajectory

LEVEL = 0.95


@dataclass
class Outcome:
    source: str
    prompt: int  # the sample's index in the held-out set
    reward: float
    correct: bool
    answer: str | None = None
    failed: str | None = None  # why the run failed, if it did
    versions: tuple[int, int] | None = None  # (oldest, newest) version of its policy tokens
    traj: Trajectory | None = None  # the run itself (the run's record keeps a few: callbacks.trace)


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k runs drawn without replacement from n, c of them correct, is correct)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def majority_correct(answers: list[str | None], correct: list[bool]) -> bool:
    """Is the most frequent answer (ties: the first seen; no answer never wins) a correct one?"""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return False
    top = votes.most_common(1)[0][0]  # Counter keeps first-seen order among equal counts
    return any(c for a, c in zip(answers, correct) if a == top)


def interval(values: Iterable[float], level: float = LEVEL,
             bounds: tuple[float, float] = (-math.inf, math.inf)) -> tuple[float, float, float]:
    """(mean, low, high): a t interval over ``values`` (one per prompt), cut to ``bounds``, the range the estimated
    mean can take (a share: (0, 1))."""
    from scipy import stats

    x = np.asarray(list(values), dtype=float)
    mean = float(x.mean())
    if len(x) < 2:
        return mean, float("nan"), float("nan")
    half = float(stats.t.ppf(0.5 + level / 2, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x)))
    return mean, max(mean - half, bounds[0]), min(mean + half, bounds[1])


def by_prompt(outcomes: list[Outcome]) -> dict[str, dict[int, list[Outcome]]]:
    """The runs of each source's prompts: ``{source: {prompt: [outcome, ...]}}``, in the order first seen."""
    runs: dict[str, dict[int, list[Outcome]]] = defaultdict(lambda: defaultdict(list))
    for o in outcomes:
        runs[o.source][o.prompt].append(o)
    return runs


def summarize(outcomes: list[Outcome], k: int) -> dict[str, dict[str, float]]:
    """Metrics per source (see the module docstring), each metric ``m`` with ``m_lo`` and ``m_hi``."""
    out = {}
    for source, prompts in by_prompt(outcomes).items():
        runs = list(prompts.values())
        per_prompt = {f"avg@{k}": [np.mean([o.reward for o in r]) for r in runs]}
        for j in sorted({1, k}):  # pass@1, and pass@k when k > 1
            per_prompt[f"pass@{j}"] = [pass_at_k(len(r), sum(o.correct for o in r), j) for r in runs]
        if any(o.answer is not None for r in runs for o in r):
            per_prompt[f"maj@{k}"] = [float(majority_correct([o.answer for o in r], [o.correct for o in r]))
                                      for r in runs]
        rewards_in_unit = all(0.0 <= o.reward <= 1.0 for r in runs for o in r)
        metrics: dict[str, float] = {}
        for name, values in per_prompt.items():
            share = not name.startswith("avg@") or rewards_in_unit
            metrics[name], metrics[f"{name}_lo"], metrics[f"{name}_hi"] = interval(
                values, bounds=(0.0, 1.0) if share else (-math.inf, math.inf))
        versions = [o.versions for r in runs for o in r if o.versions is not None]
        metrics.update(prompts=float(len(runs)), failed=float(sum(o.failed is not None for r in runs for o in r)),
                       version_min=float(min((v[0] for v in versions), default=-1)),
                       version_max=float(max((v[1] for v in versions), default=-1)))
        out[source] = metrics
    return out


def per_prompt_rewards(outcomes: list[Outcome]) -> dict[str, list[float]]:
    """Each source's mean reward per prompt, in prompt order (the unit a before/after comparison takes)."""
    return {s: [float(np.mean([o.reward for o in p[i]])) for i in sorted(p)] for s, p in by_prompt(outcomes).items()}


async def run_round(samples: list[dict], agent: Callable, sessions: AgentSessions, *, k: int, temperature: float,
                    success: float = 1.0, seed: int = 0, concurrency: int = 64, timeout_s: float = 300.0,
                    done: Callable[[], None] | None = None) -> list[Outcome]:
    """``k`` runs of ``agent`` per sample on ``sessions``' engine; run on the engine's loop; ``done()`` after each run
    (a progress bar's)."""
    from .agent_run import request_seed, run_agent  # the same runs and seeding as training, from its own seed

    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, sample: dict, member: int) -> Outcome:
        source = str(sample.get("source", "heldout"))
        # a negative group of its own per prompt: an engine pool routes each (prompt, run) by it, never with training
        traj = Trajectory(sample_id=i, group_id=-1 - i, member=f"eval{member}", sample=sample)
        async with gate:
            why = await run_agent(agent, sessions, traj, request_seed(seed, i, member), timeout_s,
                                  temperature=temperature)
        if done is not None:
            done()
        versions = [v for span in traj.policy_spans() for v in span.versions or []]
        span = (min(versions), max(versions)) if versions else None
        if why is not None:  # an evaluation run that fails scores 0, counted
            return Outcome(source, i, 0.0, False, failed=why, versions=span, traj=traj)
        answer = traj.info.get("answer")
        return Outcome(source, i, traj.reward, traj.reward >= success, None if answer is None else str(answer),
                       versions=span, traj=traj)

    return list(await asyncio.gather(*[one(i, s, m) for i, s in enumerate(samples) for m in range(k)]))


def report(round_metrics: dict[str, dict[str, float]], k: int) -> str:
    """A table of a round's main metrics with their intervals, one line per source."""
    lines = []
    for source, m in round_metrics.items():
        cells = [f"{name} {m[name]:.3f} [{m[name + '_lo']:.3f}, {m[name + '_hi']:.3f}]"
                 for name in (f"avg@{k}", "pass@1", f"pass@{k}", f"maj@{k}") if name in m]
        lines.append(f"{source}: {int(m['prompts'])} prompts x {k}: " + ", ".join(cells)
                     + f"; failed {int(m['failed'])}; versions {int(m['version_min'])}-{int(m['version_max'])}")
    return "\n".join(lines)


def table(round_metrics: dict[str, dict[str, float]], k: int) -> str:
    """A round as a table: a row per source and metric (avg@k, pass@1, pass@k, maj@k) with its value and 95% interval
    (``-`` with one prompt), then a line per source with its prompts, failures and policy versions."""
    rows = [("source", "metric", "value", "95% interval")]
    for source, m in round_metrics.items():
        for name in dict.fromkeys((f"avg@{k}", "pass@1", f"pass@{k}", f"maj@{k}")):
            if name in m:
                lo, hi = m[name + "_lo"], m[name + "_hi"]
                rows.append((source, name, f"{m[name]:.3f}", "-" if math.isnan(lo) else f"[{lo:.3f}, {hi:.3f}]"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines + [f"{source}: {int(m['prompts'])} prompts x {k} runs, {int(m['failed'])} failed, policy "
                               f"versions {int(m['version_min'])}-{int(m['version_max'])}"
                               for source, m in round_metrics.items()])


def dump(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")

