"""Verifiers: a reply and its sample in, a score and the answer read from the reply out.

A source names its verifier with a short spec (``data.Source.verifier``):

- ``exact``: the answer read from the reply (``extract``) equals the sample's ``answer`` after normalizing case,
  spaces and a trailing period;
- ``last_number``: the last number in the reply equals the answer numerically (lenient: a model that restates the
  question still scores; commas as thousands separators are ignored);
- ``regex:PATTERN``: the last match of ``PATTERN`` in the reply (its first group, else the whole match) is the answer,
  compared as ``exact`` compares;
- ``math``: ``math-verify`` (Hugging Face's grader: boxed answers, fractions, LaTeX, units) parses the reply and the
  reference and compares them symbolically;
- ``reasoning_gym``: the generating reasoning-gym dataset's own ``score_answer`` on the answer read from the reply
  (1.0 right; reasoning-gym gives 0.01 for a wrong non-empty answer);
- ``pkg.module.function``: a user function ``fn(reply, sample) -> float | (float, answer) | Verdict``.

``extract`` reads the answer from a reply: the last ``\\boxed{...}``, else the last ``<answer>...</answer>``, else
what follows the last ``Answer:`` on its line, else the whole reply.

Running them (``verify``): ``exact``, ``last_number`` and ``regex`` run inline (microseconds, nothing to hang).
``math``, ``reasoning_gym`` and user functions run in worker processes (pebble's ``ProcessPool``, spawned), each call
with a deadline: a verifier that raises, hangs or dies raises ``VerifierFailed``, which the agent turns into a failed
sample (counted, logged, never trained on), never a crashed run. A hung worker is killed at the deadline and replaced;
a thread could not be killed, and a hung sympy call holding the interpreter lock would slow the trainer (why not
threads). math-verify's own ``signal.alarm`` timeouts only work in a main thread; here they are off and the pool's
deadline takes their place.
"""

from __future__ import annotations

import asyncio
import atexit
import math
import re
import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

from ..config import NotImported, imported
from ..extras import require

INLINE = ("exact", "last_number", "regex")  # cheap and safe: no process hop
DEFAULT_TIMEOUT_S = 10.0
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass
class Verdict:
    score: float
    answer: str | None = None  # what was read from the reply (maj@k votes on it); None: nothing read


class VerifierFailed(RuntimeError):
    """The verifier raised, timed out or died: the sample fails (counted), the run goes on."""


def extract(reply: str) -> str:
    """The answer part of a reply (see the module docstring)."""
    boxed = _last_boxed(reply)
    if boxed is not None:
        return boxed.strip()
    tagged = re.findall(r"<answer>(.*?)</answer>", reply, flags=re.S)
    if tagged:
        return tagged[-1].strip()
    marked = re.findall(r"answer\s*[:：]\s*([^\n]*)", reply, flags=re.I)
    if marked:
        return marked[-1].strip()
    return reply.strip()


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unclosed


def normalize(text: Any) -> str:
    return " ".join(str(text).strip().removesuffix(".").split()).casefold()


def _exact(reply: str, sample: dict) -> Verdict:
    answer = extract(reply)
    return Verdict(float(normalize(answer) == normalize(sample["answer"])), answer or None)


def _last_number(reply: str, sample: dict) -> Verdict:
    numbers = _NUMBER.findall(reply.replace(",", ""))
    if not numbers:
        return Verdict(0.0, None)
    got, want = numbers[-1], str(sample["answer"]).replace(",", "").strip()
    try:
        right = math.isclose(float(got), float(want), rel_tol=0, abs_tol=1e-9)
    except ValueError:  # a reference that is no number: compare as text
        right = normalize(got) == normalize(want)
    return Verdict(float(right), got)


def _regex(pattern: re.Pattern) -> Callable[[str, dict], Verdict]:
    def verify(reply: str, sample: dict) -> Verdict:
        matches = list(pattern.finditer(reply))
        if not matches:
            return Verdict(0.0, None)
        m = matches[-1]
        answer = (m.group(1) if pattern.groups else m.group(0)).strip()
        return Verdict(float(normalize(answer) == normalize(sample["answer"])), answer)

    return verify


def _math(reply: str, sample: dict) -> Verdict:
    import logging

    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled" on every call: the pool has one
    reference = str(sample["answer"])
    if "$" not in reference and "\\boxed" not in reference:
        reference = f"${reference}$"  # math-verify reads LaTeX between dollars
    gold = parse(reference, parsing_timeout=None)
    got = parse(reply, parsing_timeout=None)
    answer = str(got[-1]) if got else None
    return Verdict(float(bool(got) and verify(gold, got, timeout_seconds=None)), answer)


def _reasoning_gym(reply: str, sample: dict) -> Verdict:
    import reasoning_gym

    entry = {"question": sample.get("question", ""), "answer": sample["answer"], "metadata": sample["metadata"]}
    answer = extract(reply)
    score = reasoning_gym.get_score_answer_fn(sample["metadata"]["source_dataset"])(answer, entry)
    return Verdict(float(score), answer or None)


BUILTIN = {"exact": (_exact, None), "last_number": (_last_number, None), "math": (_math, "math_verify"),
           "reasoning_gym": (_reasoning_gym, "reasoning_gym")}  # name: (function, the package it needs)


@lru_cache(maxsize=None)
def resolve(spec: str) -> Callable[[str, dict], Verdict | float | tuple]:
    """The function behind ``spec``; raises ``ValueError`` naming the fix for a spec that does not resolve."""
    if spec in BUILTIN:
        fn, package = BUILTIN[spec]
        if package is not None:
            require("data", f"verifier {spec!r}", (package,))
        return fn
    if spec.startswith("regex:"):
        try:
            return _regex(re.compile(spec.removeprefix("regex:")))
        except re.error as e:
            raise ValueError(f"verifier {spec!r}: the pattern does not compile ({e})") from None
    try:
        fn, why = imported(spec, "verifier"), ""
    except NotImported as e:
        fn, why = None, f" ({e.reason})"
    if not callable(fn):
        raise ValueError(f"verifier {spec!r} is not one of {', '.join(BUILTIN)}, regex:PATTERN, or an importable "
                         f"function{why}: name a built-in or the dotted path of fn(reply, sample) -> score")
    return fn


def run(spec: str, reply: str, sample: dict) -> Verdict:
    """``spec`` on one reply, in this process (what a worker runs)."""
    out = resolve(spec)(reply, sample)
    if isinstance(out, Verdict):
        verdict = out
    elif isinstance(out, tuple) and len(out) == 2:
        verdict = Verdict(out[0], None if out[1] is None else str(out[1]))
    else:
        verdict = Verdict(out)
    try:
        verdict.score = float(verdict.score)
    except (TypeError, ValueError):
        raise VerifierFailed(f"verifier {spec} returned {out!r}, not a score") from None
    if not math.isfinite(verdict.score):
        raise VerifierFailed(f"verifier {spec} returned the non-finite score {verdict.score}")
    return verdict


async def verify(spec: str, reply: str, sample: dict, timeout_s: float = DEFAULT_TIMEOUT_S) -> Verdict:
    """Score ``reply``; raises ``VerifierFailed`` when the verifier raised, hung past ``timeout_s`` or died."""
    inline = spec.split(":")[0] in INLINE  # run here: nothing to time out or cancel
    future = None if inline else _pool().schedule(run, args=(spec, reply, sample), timeout=timeout_s)
    try:
        return run(spec, reply, sample) if inline else await asyncio.wrap_future(future)
    except VerifierFailed:
        raise
    except TimeoutError:  # the pool's deadline
        raise VerifierFailed(f"verifier {spec} did not answer within {timeout_s} s (its worker was killed)") from None
    except asyncio.CancelledError:
        future.cancel()
        raise
    except Exception as e:
        raise VerifierFailed(f"verifier {spec} raised {type(e).__name__}: {e}") from e


_POOL = None
_POOL_LOCK = threading.Lock()
WORKERS = 2


def _pool():
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            import multiprocessing

            from pebble import ProcessPool

            # spawn: forking a process that runs engine threads could copy a held lock into the child
            _POOL = ProcessPool(max_workers=WORKERS, context=multiprocessing.get_context("spawn"))
            atexit.register(close)
        return _POOL


def close() -> None:
    """Stop the verifier workers (at exit; tests call it to start afresh)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None:
            _POOL.stop()
            _POOL.join(timeout=10)
            _POOL = None
