"""A judge: a model that grades a reply, its verdict read as a reward in [0, 1].

``Judge`` fills a prompt template with the question, the reply and (if any) the reference answer, asks a judge model,
and reads the verdict from its reply with a configurable parser (``verdict``):

- ``score:LO-HI``: the last number after ``Score:``, else the last number of the reply (``7/10`` and ``7 out of 10``
  read as 7), which must lie in [LO, HI]; mapped linearly to [0, 1];
- ``yes_no``: the last ``Verdict: yes|no``, else the last standalone yes/no word; yes is 1, no is 0;
- ``letter:A=1,B=0.5,C=0``: the last ``Grade: X`` of those labels, else the last standalone one (case-sensitive:
  ``A`` is not ``a``); each label's value, in [0, 1].

The judge model is either an ``engines.Auxiliary`` (a frozen model on an engine of its own, started at the first
request; the prompt rendered by its chat template) or any OpenAI-compatible chat-completions server (``url``: a
``molt serve`` server, vLLM, an API; its key read from the environment variable ``api_key_env``).

Calls: at most ``max_in_flight`` at once, each waiting at most ``slot_timeout_s`` for a slot, then ``timeout_s`` from
being sent; without ``served_model``, one ``/v1/models`` request (shared by every caller) names the model. ``check``
asks a test question; ``callbacks.RolloutMonitor`` calls it before the policy engine starts, so a wrong URL, key or
model name fails a run in seconds.

Failures are ``JudgeFailed`` (a ``VerifierFailed``: the agent fails that sample, counted, never trained on; never a
silent 0; its message names the URL, port, model and status), with a ``kind``: ``timeout`` (no answer within
``timeout_s`` of being sent), ``slot_timeout`` (no free slot within ``slot_timeout_s``: nothing sent),
``http_error`` (a refused connection, a non-200 answer, a body that is no chat completion), ``engine_error`` (the
auxiliary engine raised), ``unparsable`` (no verdict in the reply), ``out_of_range`` (a score outside [LO, HI]),
``no_reference`` (the template names ``{reference}`` and the sample has none). ``samples > 1`` asks that many times
(seeds 0, 1, ...; temperature > 0) and averages the verdicts that parse; it fails only when none does.

Identical prompts, in flight or recently judged, are judged once: an LRU of the judging tasks keyed by the filled
prompt (``cache_size`` of them); a failure is forgotten once it settles, so the next request asks again.

Written by hand, and why: the verdict parsers (a few regexes; an LLM-judge library would bring a fixed rubric and
its own client), the HTTP call (one POST with aiohttp: the ``openai`` client retries, keeps a pool bound to one event
loop and would hide the status of a refusal) and the dedup cache (``functools`` caches neither coroutines nor
failures-as-misses).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import string
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache, partial

from ..engines.auxiliary import Auxiliary, AuxiliaryFailed
from ..engines.base import Sampling
from .graders import VerifierFailed

KINDS = ("timeout", "slot_timeout", "http_error", "engine_error", "unparsable", "out_of_range", "no_reference")
FIELDS = ("question", "response", "reference", "format")
_NUM = r"-?\d+(?:\.\d+)?"
_FREE = rf"(?<![\w.]){_NUM}"  # a number of its own: not the 2 of v2, not the -8 of 7-8
_SCORE = re.compile(rf"score\W{{0,3}}?[:=]\s*\**\s*({_FREE})", re.I)  # Score: 7, **Score:** 7, score = 7
_ANY_NUMBER = re.compile(rf"({_FREE})(?:\s*(?:/|out of)\s*{_NUM})?", re.I)  # 7/10 -> 7
_YES_NO_LINE = re.compile(r"verdict\W{0,3}?[:=]\s*\**\s*(yes|no)\b", re.I)
_YES_NO = re.compile(r"\b(yes|no)\b", re.I)

RUBRIC = """Grade the response to the question below.

Question:
{question}

Response:
{response}

{format}"""

REFERENCE_RUBRIC = """Grade the response to the question below against the reference answer.

Question:
{question}

Reference answer:
{reference}

Response:
{response}

{format}"""


class JudgeFailed(VerifierFailed):
    """The judge did not give a verdict (``kind``: one of ``KINDS``); ``prompt`` and ``raw`` (its replies) if any."""

    def __init__(self, kind: str, message: str, prompt: str | None = None, raw: list[str] | None = None):
        super().__init__(f"judge {kind}: {message}")
        self.kind, self.detail, self.prompt, self.raw = kind, message, prompt, raw or []

    def __reduce__(self):  # pickled whole (a broadcast to other ranks), not as JudgeFailed(str(self))
        return JudgeFailed, (self.kind, self.detail, self.prompt, self.raw)


@dataclass
class JudgeVerdict:
    score: float  # in [0, 1]: the mean of the samples that parsed
    prompt: str  # the filled template the judge read
    raw: list[str]  # the judge's replies (those of failed calls excepted)
    cached: bool = False  # judged before (or in flight for another caller): no request of its own
    scores: list[float] = field(default_factory=list)  # each parsed sample's score
    failed: list[str] = field(default_factory=list)  # the kind of each sample that gave no verdict

    def info(self) -> dict:
        """Every field, as a JSON-ready dict (a trajectory's ``info["judge"]``)."""
        return asdict(self)


# ----- verdicts: pure functions -----
@lru_cache(maxsize=64)
def verdict_spec(spec: str) -> tuple:
    """``("score", lo, hi)``, ``("yes_no",)`` or ``("letter", {label: value})``; ``ValueError`` naming the shapes."""
    shapes = "score:LO-HI (e.g. score:0-10), yes_no, or letter:A=1,B=0.5,C=0"
    if spec == "yes_no":
        return ("yes_no",)
    if m := re.fullmatch(rf"score:({_NUM})-({_NUM})", spec.replace(" ", "")):
        lo, hi = float(m[1]), float(m[2])
        if lo >= hi:
            raise ValueError(f"judge verdict {spec!r}: LO must be below HI")
        return ("score", lo, hi)
    if spec.startswith("letter:"):
        labels = {}
        for part in spec.removeprefix("letter:").split(","):
            label, _, value = part.strip().partition("=")
            try:
                labels[label.strip()] = float(value)
            except ValueError:
                raise ValueError(f"judge verdict {spec!r}: {part!r} is not LABEL=VALUE; write {shapes}") from None
        if not all(re.fullmatch(r"\w+", k) for k in labels) or not all(0 <= v <= 1 for v in labels.values()):
            raise ValueError(f"judge verdict {spec!r}: labels are letters or words, values in [0, 1]")
        return ("letter", labels)
    raise ValueError(f"judge verdict {spec!r} is not one of {shapes}")


def parse_verdict(spec: str, text: str) -> float:
    """The score in [0, 1] that ``text`` gives under ``spec`` (module docstring); ``JudgeFailed`` (``unparsable``,
    ``out_of_range``) if none."""
    shape = verdict_spec(spec)
    if shape[0] == "score":
        lo, hi = shape[1], shape[2]
        found = _SCORE.findall(text) or _ANY_NUMBER.findall(text)
        if not found:
            raise JudgeFailed("unparsable", f"no score in the judge's reply {_short(text)!r}")
        x = float(found[-1])
        if not lo <= x <= hi:
            raise JudgeFailed("out_of_range", f"the judge's score {x:g} is outside [{lo:g}, {hi:g}]")
        return (x - lo) / (hi - lo)
    if shape[0] == "yes_no":
        found = _YES_NO_LINE.findall(text) or _YES_NO.findall(text)
        if not found:
            raise JudgeFailed("unparsable", f"no yes or no in the judge's reply {_short(text)!r}")
        return float(found[-1].lower() == "yes")
    labels = shape[1]
    alternatives = "|".join(re.escape(k) for k in sorted(labels, key=len, reverse=True))
    found = (re.findall(rf"(?i:grade)\W{{0,3}}?[:=]\s*\**\s*({alternatives})(?!\w)", text)
             or re.findall(rf"(?<!\w)({alternatives})(?!\w)", text))
    if not found:
        raise JudgeFailed("unparsable", f"none of {', '.join(labels)} in the judge's reply {_short(text)!r}")
    return labels[found[-1]]


def instructions(spec: str) -> str:
    """What the default rubric asks for (its ``{format}``), in the verdict's shape."""
    shape = verdict_spec(spec)
    if shape[0] == "score":
        return (f"Reply with `Score: N` only, where N is a number from {shape[1]:g} (wrong or useless) to "
                f"{shape[2]:g} (fully correct).")
    if shape[0] == "yes_no":
        return "Is the response correct? Reply with `Verdict: yes` or `Verdict: no` only."
    grades = ", ".join(f"{k} (worth {v:g})" for k, v in shape[1].items())
    return f"Reply with `Grade: X` only, where X is one of {grades}; 1 is fully correct, 0 wrong."


def _short(text: str, n: int = 200) -> str:
    return text if len(text) <= n else text[:n] + "..."


# ----- the judge -----
class Judge:
    def __init__(self, model: Auxiliary | None = None, url: str | None = None, served_model: str | None = None,
                 api_key_env: str | None = None, template: str | None = None, system: str | None = None,
                 verdict: str = "score:0-10", samples: int = 1, temperature: float = 0.0, max_tokens: int = 64,
                 timeout_s: float = 60.0, max_in_flight: int = 16, slot_timeout_s: float = 300.0,
                 cache_size: int = 4096):
        """``model``: an ``Auxiliary`` serving the judge, or ``url``: an OpenAI-compatible server (``http://host:port``
        or ``.../v1``) asked for ``served_model`` (None: the first of its ``/v1/models``), with the key in the
        environment variable ``api_key_env``; ``template``: a format string over ``{question}``, ``{response}``,
        ``{reference}`` and ``{format}`` (the verdict's instructions), literal braces as ``{{ }}`` (None: ``RUBRIC``,
        or ``REFERENCE_RUBRIC`` for a sample with a reference); ``system``: a system message put first;
        ``max_in_flight``, ``slot_timeout_s``, ``timeout_s``: the calls' limits (the module docstring)."""
        if (model is None) == (url is None):
            raise ValueError("Judge: give exactly one of model (an Auxiliary serving the judge) and url (an "
                             f"OpenAI-compatible server), got model={model!r}, url={url!r}")
        if (samples < 1 or max_tokens < 1 or timeout_s <= 0 or slot_timeout_s <= 0 or max_in_flight < 1
                or cache_size < 0 or temperature < 0):
            raise ValueError("Judge: samples, max_tokens and max_in_flight must be >= 1, timeout_s and slot_timeout_s "
                             f"> 0, cache_size and temperature >= 0; got {samples}, {max_tokens}, {max_in_flight}, "
                             f"{timeout_s}, {slot_timeout_s}, {cache_size}, {temperature}")
        if samples > 1 and temperature == 0:
            raise ValueError(f"Judge: samples={samples} at temperature 0 would ask the same greedy question "
                             f"{samples} times: set temperature > 0 (e.g. 0.7) or samples: 1")
        verdict_spec(verdict)
        names = set() if template is None else {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
        if template is not None and ("response" not in names or not names <= set(FIELDS)):
            raise ValueError(f"Judge: the template must name {{response}} and may name only "
                             f"{', '.join('{' + f + '}' for f in FIELDS)}; it names {sorted(names)} (write "
                             "literal braces as {{ }})")
        if api_key_env is not None and not os.environ.get(api_key_env):
            raise ValueError(f"Judge: the environment variable {api_key_env} (api_key_env) is not set: export the "
                             "judge's API key there")
        self.model, self.url, self.served_model, self.api_key_env = model, url, served_model, api_key_env
        self.template, self.system, self.verdict, self.samples = template, system, verdict, samples
        self.temperature, self.max_tokens, self.timeout_s = temperature, max_tokens, timeout_s
        self.max_in_flight, self.slot_timeout_s, self.cache_size = max_in_flight, slot_timeout_s, cache_size
        self._needs_reference = "reference" in names
        self._system = [{"role": "system", "content": system}] if system else []
        self.endpoint, self.models_url = _endpoints(url) if url else (None, None)
        self._cache: OrderedDict[str, tuple] = OrderedDict()  # prompt -> (loop, task judging it)
        self._lock = threading.Lock()
        self._slots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its semaphore
        self._listing: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its /v1/models task

    def __repr__(self) -> str:
        return f"Judge({self.where}, verdict={self.verdict!r}, samples={self.samples})"

    @property
    def where(self) -> str:  # in every failure's message
        model = f" (model {self.served_model})" if self.served_model else ""
        return self.endpoint + model if self.model is None else f"{self.model.name} ({self.model.model})"

    def check(self) -> str | None:
        """Ask a judge behind a URL one test question now, in an event loop of its own (at the start of a run, before
        the policy engine: ``callbacks.RolloutMonitor``): its reply, or ``JudgeFailed`` with what to check. A judge on
        an ``Auxiliary`` is not asked: it starts at its first request, once the policy engine has taken its memory."""
        if self.model is not None:
            return None
        ask = self._ask(self._system + [{"role": "user", "content": self.prompt("What is 2 + 2?", "4", "4")}], 0)
        try:
            with ThreadPoolExecutor(1) as pool:  # a fresh loop, whether or not one runs on this thread
                return pool.submit(asyncio.run, ask).result()
        except JudgeFailed as e:
            key = f"${self.api_key_env}" if self.api_key_env else "none sent: set api_key_env"
            raise JudgeFailed(e.kind, f"{e.detail}. The judge did not answer a test question at the start of the run: "
                              f"check its url ({self.url}: an OpenAI-compatible server), its key ({key}), the model "
                              f"name it serves (served_model: {self.served_model or 'the first of /v1/models'}) and "
                              f"timeout_s ({self.timeout_s:g} s)") from None

    def prompt(self, question: str, response: str, reference: str | None = None) -> str:
        """The filled template; ``JudgeFailed`` (``no_reference``) when it names ``{reference}`` and there is none."""
        template = self.template or (RUBRIC if reference is None else REFERENCE_RUBRIC)
        if reference is None and self._needs_reference:
            raise JudgeFailed("no_reference", "the judge's template names {reference} and this sample has no "
                              "reference answer: give the source an answer field, or a template without it")
        return template.format(question=question, response=response, reference=reference,
                               format=instructions(self.verdict))

    async def grade(self, question: str, response: str, reference: str | None = None) -> JudgeVerdict:
        """The judge's verdict on ``response``; ``JudgeFailed`` if it gives none. Identical prompts are judged once."""
        prompt = self.prompt(question, response, None if reference is None else str(reference))
        loop = asyncio.get_running_loop()
        with self._lock:
            entry = self._cache.get(prompt)
            usable = entry is not None and (entry[0] is loop or entry[1].done()) and not _failed(entry[1])
            if usable:
                self._cache.move_to_end(prompt)
                task = entry[1]
            else:
                task = loop.create_task(self._judge(prompt))  # its own task: a cancelled caller cancels no other
                task.add_done_callback(partial(self._settled, prompt))
                if self.cache_size:
                    self._cache[prompt] = (loop, task)
                    while len(self._cache) > self.cache_size:
                        self._cache.popitem(last=False)
        verdict = task.result() if task.done() else await asyncio.shield(task)
        return replace(verdict, cached=True) if usable else verdict

    def _settled(self, prompt: str, task: asyncio.Task) -> None:
        if _failed(task):  # failures are not cached: the next request asks again
            with self._lock:
                if self._cache.get(prompt, (None, None))[1] is task:
                    del self._cache[prompt]

    async def _judge(self, prompt: str) -> JudgeVerdict:
        messages = self._system + [{"role": "user", "content": prompt}]
        outs = await asyncio.gather(*(self._ask(messages, seed) for seed in range(self.samples)),
                                    return_exceptions=True)
        raw, scores, failures = [], [], []
        for out in outs:
            if isinstance(out, JudgeFailed):
                failures.append(out)
                continue
            if isinstance(out, BaseException):
                raise out
            raw.append(out)
            try:
                scores.append(parse_verdict(self.verdict, out))
            except JudgeFailed as e:
                failures.append(e)
        if not scores:
            why = failures[0].detail if len(failures) == 1 else (
                f"none of {len(failures)} calls gave a verdict: " + "; ".join(str(f) for f in failures))
            raise JudgeFailed(failures[0].kind, why, prompt, raw)
        return JudgeVerdict(sum(scores) / len(scores), prompt, raw, False, scores, [f.kind for f in failures])

    async def _ask(self, messages: list[dict], seed: int) -> str:
        """One judge call's reply: a wait of at most ``slot_timeout_s`` for one of the ``max_in_flight`` slots, then
        ``timeout_s`` from the request being sent (the model list, if asked for, included)."""
        slots = self._slots.setdefault(asyncio.get_running_loop(), asyncio.Semaphore(self.max_in_flight))
        try:
            async with asyncio.timeout(self.slot_timeout_s):  # in this task: a cancelled wait never keeps a slot
                await slots.acquire()
        except TimeoutError:
            raise JudgeFailed("slot_timeout", f"{self.where}: waited {self.slot_timeout_s:g} s for a free connection "
                              f"slot ({self.max_in_flight} in use), nothing sent: raise the judge's max_in_flight (if "
                              "the server takes more at once) or slot_timeout_s, or give it a faster server") from None
        try:
            async with asyncio.timeout(self.timeout_s):
                return await (self._ask_url(messages, seed) if self.model is None else
                              self._ask_engine(messages, seed))
        except TimeoutError:
            raise JudgeFailed("timeout", f"{self.where} did not answer within {self.timeout_s:g} s of the request "
                              "being sent: raise the judge's timeout_s, lower its max_tokens, or give it a faster "
                              "server") from None
        finally:
            slots.release()

    async def _ask_engine(self, messages: list[dict], seed: int) -> str:
        aux = self.model
        try:
            if aux.tokenizer is None:
                await asyncio.to_thread(aux.start)
            ids = aux.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5: a BatchEncoding
            out = await aux.generate(ids, Sampling(max_tokens=self.max_tokens, temperature=self.temperature, seed=seed))
            return aux.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        except AuxiliaryFailed as e:
            raise JudgeFailed(e.kind, str(e)) from e
        except Exception as e:
            raise JudgeFailed("engine_error", f"{self.where}: {type(e).__name__}: {e}") from e

    async def _ask_url(self, messages: list[dict], seed: int) -> str:
        body = {"model": await self._served(), "messages": messages, "max_tokens": self.max_tokens,
                "temperature": self.temperature, "seed": seed}
        content = await self._http(self.endpoint, body, lambda out: out["choices"][0]["message"]["content"])
        return "" if content is None else str(content)

    async def _served(self) -> str:
        """``served_model``, else the first of ``/v1/models``: asked once, every caller awaiting the one request in
        flight on its loop (a failed one is asked again by the next caller); the answer kept."""
        if self.served_model is None:
            listing = self._listing.get(loop := asyncio.get_running_loop())
            if listing is None or _failed(listing):
                first = self._http(self.models_url, None, lambda out: str(out["data"][0]["id"]))
                listing = self._listing[loop] = loop.create_task(asyncio.wait_for(first, self.timeout_s))
            served = await asyncio.shield(listing)  # a caller that gives up does not cancel the others' request
            self.served_model = self.served_model or served
        return self.served_model

    async def _http(self, url: str, body: dict | None, read: Callable):
        """``read`` of the JSON answer to a GET (``body`` None) or a POST; ``http_error`` names URL, model, status."""
        import aiohttp

        who, text = url + (f" (model {body['model']})" if body else ""), ""
        headers = {"Authorization": f"Bearer {os.environ.get(self.api_key_env, '')}"} if self.api_key_env else {}
        try:
            async with aiohttp.ClientSession(headers=headers) as session:
                async with session.request("GET" if body is None else "POST", url, json=body) as r:
                    status, text = r.status, await r.text()
            if status != 200:
                raise JudgeFailed("http_error", f"{who} answered HTTP {status}: {_short(text)}")
            return read(json.loads(text))
        except aiohttp.ClientError as e:
            raise JudgeFailed("http_error", f"{who}: {type(e).__name__}: {e}") from e
        except ValueError:
            raise JudgeFailed("http_error", f"{who} answered no JSON: {_short(text)!r}") from None
        except (KeyError, IndexError, TypeError) as e:
            raise JudgeFailed("http_error", f"{who} answered no OpenAI shape ({type(e).__name__}: {e})") from e


def check_judges(*holders) -> int:
    """``Judge.check`` on each judge among ``holders`` and their attributes (an ``Answer``'s ``judge``); how many."""
    judges = {id(j): j for h in holders for j in (h, *getattr(h, "__dict__", {}).values()) if isinstance(j, Judge)}
    return len([judge.check() for judge in judges.values()])


def _endpoints(url: str) -> tuple[str, str]:
    """(chat completions, models) of a server's address, given with or without ``/v1`` (or the full route)."""
    root = url.rstrip("/").removesuffix("/chat/completions")
    root = root if root.endswith("/v1") else root + "/v1"
    return root + "/chat/completions", root + "/models"


def _failed(task: asyncio.Future) -> bool:
    return task.done() and (task.cancelled() or task.exception() is not None)
