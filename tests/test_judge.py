"""The judge grader (``molt_lightning.data.judge``): its verdict parsers on every shape and failure, a judge behind an
OpenAI-compatible server (a fake one on 127.0.0.1 that answers canned replies and counts requests: each failure kind,
deduplication, sampling), ``Answer`` mixing the rule verifier's score with the judge's, the sample log keeping what
the judge said, a recipe's YAML building the judge, and the engine path on the tiny policy."""

from __future__ import annotations

import asyncio
import json
import pickle
import socket
import threading
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from molt_lightning.agents import Answer
from molt_lightning.callbacks import RolloutSamples  # (imports Lightning: seconds, once, at collection)
from molt_lightning.data.graders import VerifierFailed
from molt_lightning.data.judge import (REFERENCE_RUBRIC, RUBRIC, Judge, JudgeFailed, check_judges, instructions,
                                       parse_verdict, verdict_spec)

DEADLINE_S = 30.0  # what a wait on the fake server may take at most (it answers in milliseconds)


class FakeJudgeServer:
    """``/v1/chat/completions`` and ``/v1/models`` on 127.0.0.1, in a thread of its own. Each chat request gets the
    next of ``replies`` (the last one repeats): a text (a 200 chat completion with that content), an int (that HTTP
    status), ``"HANG"`` (no answer until the server stops), ``"GATE"`` (``Score: 6`` once ``open_gate`` is called),
    ``"SLOW"`` (``Score: 6`` after ``slow_s``) or ``"NOT JSON"`` (a 200 that is no JSON). ``arrived`` is set at each
    request; ``model_lists`` counts the ``/v1/models`` requests (each answered after ``models_s``)."""

    def __init__(self, *replies, slow_s: float = 0.0, models_s: float = 0.0):
        self.replies, self.requests, self.headers = list(replies), [], []
        self.slow_s, self.models_s, self.model_lists = slow_s, models_s, 0
        self._started, self._loop, self._release, self._gate = threading.Event(), None, None, None
        self.arrived = threading.Event()

    def __enter__(self) -> FakeJudgeServer:
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)
        self._thread.start()
        assert self._started.wait(DEADLINE_S), "the fake judge server did not start"
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._release.set)
        self._thread.join(DEADLINE_S)

    def open_gate(self) -> None:
        self._loop.call_soon_threadsafe(self._gate.set)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self) -> None:
        from aiohttp import web

        self._loop, self._release, self._gate = asyncio.get_running_loop(), asyncio.Event(), asyncio.Event()

        async def chat(request):
            self.requests.append(await request.json())
            self.headers.append(dict(request.headers))
            reply = self.replies[min(len(self.requests), len(self.replies)) - 1]
            self.arrived.set()
            if reply == "GATE":
                await self._gate.wait()
                reply = "Score: 6"
            if reply == "SLOW":  # a slow judge's latency, server side
                await asyncio.sleep(self.slow_s)
                reply = "Score: 6"
            if reply == "HANG":
                await self._release.wait()
                return web.Response(status=503)
            if reply == "NOT JSON":
                return web.Response(text="<html>a proxy page</html>")
            if isinstance(reply, int):
                return web.Response(status=reply, text="invalid api key" if reply == 401 else "the judge is overloaded")
            return web.json_response({"object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}]})

        async def models(request):
            self.model_lists += 1
            await asyncio.sleep(self.models_s)
            return web.json_response({"object": "list", "data": [{"id": "judge-model", "object": "model"}]})

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self._started.set()
        await self._release.wait()
        await runner.cleanup()


class FakeClient:
    """What ``Answer`` uses of the agent client: one chat turn (a canned reply) and the event counter."""

    def __init__(self, reply: str):
        self.reply, self.counts = reply, Counter()

    async def chat_turn(self, messages, *, max_tokens, tools=None):
        return {"role": "assistant", "content": self.reply}, None

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] += n


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, DEADLINE_S))


def failure(coro) -> JudgeFailed:
    with pytest.raises(JudgeFailed) as e:
        run(coro)
    return e.value


def closed_port() -> int:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----- the verdict parsers -----
@pytest.mark.parametrize("spec, text, score", [
    ("score:0-10", "Score: 7", 0.7),
    ("score:0-10", "The reply is right.\n**Score:** 8.5", 0.85),
    ("score:0-10", "score = 3, though 9 would be generous", 0.3),  # the Score: number wins over a later one
    ("score:0-10", "I give it 7/10", 0.7),
    ("score:0-10", "a 6 out of 10", 0.6),
    ("score:0-10", "maybe 2, maybe 4", 0.4),  # no Score: the last number
    ("score:1-5", "Score: 1", 0.0),
    ("score:1-5", "Score: 5", 1.0),
    ("score:1-5", "between 4-3", 0.5),  # 3, not -3
    ("yes_no", "Yes, mostly. Verdict: no", 0.0),  # the Verdict line wins
    ("yes_no", "**Verdict:** YES", 1.0),
    ("yes_no", "no, wait: yes", 1.0),
    ("letter:A=1,B=0.5,C=0", "Grade: B (A would be too kind)", 0.5),
    ("letter:A=1,B=0.5,C=0", "A fair attempt. C", 0.0),
    ("letter:A=1,B=0.5,C=0", "grade: A", 1.0),
    ("letter:CORRECT=1,INCORRECT=0", "INCORRECT", 0.0),
    ("letter:CORRECT=1,INCORRECT=0", "It is CORRECT.", 1.0),
])
def test_every_verdict_shape_reads_its_score(spec, text, score):
    assert parse_verdict(spec, text) == pytest.approx(score)


@pytest.mark.parametrize("spec, text, kind", [
    ("score:0-10", "", "unparsable"),
    ("score:0-10", "It is a fine answer.", "unparsable"),
    ("score:0-10", "Score: 11", "out_of_range"),
    ("score:0-10", "Score: -1", "out_of_range"),
    ("score:1-5", "Score: 0.5", "out_of_range"),
    ("yes_no", "Perhaps.", "unparsable"),
    ("yes_no", "nobody knows", "unparsable"),  # a word holding "no" is not a no
    ("letter:A=1,B=0.5,C=0", "Grade: a", "unparsable"),  # labels are case-sensitive
    ("letter:A=1,B=0.5,C=0", "ABC", "unparsable"),
])
def test_a_reply_without_a_verdict_is_a_failure_of_its_kind(spec, text, kind):
    with pytest.raises(JudgeFailed) as e:
        parse_verdict(spec, text)
    assert e.value.kind == kind and isinstance(e.value, VerifierFailed)


def test_bad_settings_are_refused_with_the_fix():
    for spec in ("score", "score:10-0", "letter:A=2", "letter:A", "stars"):
        with pytest.raises(ValueError, match="judge verdict"):
            verdict_spec(spec)
    url = "http://127.0.0.1:9"
    cases = [(dict(), "exactly one of model"), (dict(url=url, model=object()), "exactly one of model"),
             (dict(url=url, samples=3), "temperature > 0"), (dict(url=url, template="Grade {question}"), "{response}"),
             (dict(url=url, template="{response} {answer}"), "may name only"),
             (dict(url=url, api_key_env="MOLT_NO_SUCH_KEY_VAR"), "MOLT_NO_SUCH_KEY_VAR"),
             (dict(url=url, verdict="stars"), "score:LO-HI"), (dict(url=url, timeout_s=0), "timeout_s > 0")]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            Judge(**kwargs)
    with pytest.raises(ValueError, match="judge_weight in"):
        Answer(judge_weight=1.5)


def test_the_prompt_fills_the_template_and_a_missing_reference_is_named():
    judge = Judge(url="http://127.0.0.1:9", verdict="yes_no")
    assert judge.prompt("Q?", "R.") == RUBRIC.format(question="Q?", response="R.", format=instructions("yes_no"))
    assert "Reference answer:\n42" in judge.prompt("Q?", "R.", "42") and REFERENCE_RUBRIC.startswith("Grade")
    assert "`Verdict: yes`" in instructions("yes_no") and "`Score: N`" in instructions("score:0-10")
    custom = Judge(url="http://127.0.0.1:9", template="{{literal}} {question} vs {reference}: {response}")
    assert custom.prompt("Q", "R", "A") == "{literal} Q vs A: R"
    assert Judge(url="http://127.0.0.1:9", template="{{reference}}: {response}").prompt("Q", "R") == "{reference}: R"
    e = failure(custom.grade("Q", "R"))  # nothing asked: the port is closed and would be an http_error
    assert e.kind == "no_reference" and "{reference}" in str(e)


# ----- a judge behind an OpenAI-compatible server -----
def test_a_judge_at_a_url_sends_an_openai_request_and_reads_the_verdict(monkeypatch):
    monkeypatch.setenv("MOLT_TEST_JUDGE_KEY", "sk-test")
    with FakeJudgeServer("Looks right.\nScore: 8") as server:
        judge = Judge(url=server.url + "/v1/", api_key_env="MOLT_TEST_JUDGE_KEY", system="You grade.", max_tokens=32)
        verdict = run(judge.grade("What is 5+7?", "12", 12))
    assert verdict.score == pytest.approx(0.8) and verdict.raw == ["Looks right.\nScore: 8"] and not verdict.cached
    assert "What is 5+7?" in verdict.prompt and "Reference answer:\n12" in verdict.prompt
    [body] = server.requests
    assert body["model"] == "judge-model"  # served_model None: the first of /v1/models
    assert body["messages"] == [{"role": "system", "content": "You grade."},
                                {"role": "user", "content": verdict.prompt}]
    assert (body["max_tokens"], body["temperature"], body["seed"]) == (32, 0.0, 0)
    assert server.headers[0]["Authorization"] == "Bearer sk-test"


@pytest.mark.parametrize("reply, kind", [(500, "http_error"), ("NOT JSON", "http_error"),
                                         ("I would rather not say.", "unparsable"), ("Score: 12", "out_of_range")])
def test_each_failure_of_a_served_judge_is_its_kind_and_keeps_the_reply(reply, kind):
    with FakeJudgeServer(reply) as server:
        e = failure(Judge(url=server.url, served_model="m").grade("Q", "R"))
    assert e.kind == kind and e.prompt is not None and len(server.requests) == 1
    assert e.raw == ([reply] if kind in ("unparsable", "out_of_range") else [])
    if reply == 500:
        assert "HTTP 500" in str(e) and "overloaded" in str(e)


def test_a_judge_that_does_not_answer_in_time_is_a_timeout():
    with FakeJudgeServer("HANG") as server:
        e = failure(Judge(url=server.url, served_model="m", timeout_s=0.3).grade("Q", "R"))
    assert e.kind == "timeout" and "0.3 s" in str(e)


def test_a_judge_that_refuses_the_connection_is_an_http_error():
    port = closed_port()
    e = failure(Judge(url=f"http://127.0.0.1:{port}", served_model="m").grade("Q", "R"))
    assert e.kind == "http_error" and f"127.0.0.1:{port}" in str(e)


def test_identical_prompts_are_judged_once_and_different_ones_each():
    with FakeJudgeServer("Score: 6") as server:
        judge = Judge(url=server.url, served_model="m")

        async def grades():
            same = await asyncio.gather(*(judge.grade("Q", "R", "A") for _ in range(8)))
            different = await asyncio.gather(*(judge.grade("Q", f"R{i}", "A") for i in range(3)))
            again = await judge.grade("Q", "R", "A")
            return same, different, again

        same, different, again = run(grades())
    assert len(server.requests) == 1 + 3
    assert [v.cached for v in same].count(False) == 1 and all(v.score == pytest.approx(0.6) for v in same)
    assert not any(v.cached for v in different) and again.cached


def test_a_cancelled_caller_does_not_cancel_the_judging_others_wait_for():
    """The rollout cancels an agent that runs past its deadline: another sample waiting on the same prompt still
    gets the verdict."""
    with FakeJudgeServer("GATE") as server:
        judge = Judge(url=server.url, served_model="m")

        async def grades():
            first, second = (asyncio.create_task(judge.grade("Q", "R")) for _ in range(2))
            assert await asyncio.to_thread(server.arrived.wait, DEADLINE_S)
            first.cancel()
            server.open_gate()
            return await second, await asyncio.gather(first, return_exceptions=True)

        second, [first] = run(grades())
    assert isinstance(first, asyncio.CancelledError) and second.score == pytest.approx(0.6) and second.cached
    assert len(server.requests) == 1


def test_the_cache_keeps_at_most_cache_size_prompts():
    with FakeJudgeServer("Score: 6") as server:
        judge = Judge(url=server.url, served_model="m", cache_size=1)

        async def grades():
            for response in ("R1", "R2", "R1"):  # R2 evicts R1
                await judge.grade("Q", response)

        run(grades())
    assert len(server.requests) == 3


def test_failures_are_not_cached():
    with FakeJudgeServer(500, "Score: 5") as server:
        judge = Judge(url=server.url, served_model="m")
        assert failure(judge.grade("Q", "R")).kind == "http_error"
        verdict = run(judge.grade("Q", "R"))
    assert len(server.requests) == 2 and verdict.score == pytest.approx(0.5) and not verdict.cached


def test_samples_average_the_verdicts_that_parse_and_count_the_rest():
    with FakeJudgeServer("Score: 10", "no idea", "Score: 4") as server:
        verdict = run(Judge(url=server.url, served_model="m", samples=3, temperature=0.7).grade("Q", "R"))
    assert verdict.score == pytest.approx((1.0 + 0.4) / 2) and verdict.failed == ["unparsable"]
    assert sorted(b["seed"] for b in server.requests) == [0, 1, 2]
    assert {b["temperature"] for b in server.requests} == {0.7}
    assert sorted(verdict.raw) == sorted(["Score: 10", "no idea", "Score: 4"]) and len(verdict.scores) == 2
    with FakeJudgeServer("no idea", "Score: 99", 500) as server:
        e = failure(Judge(url=server.url, served_model="m", samples=3, temperature=0.7).grade("Q", "R"))
    assert len(server.requests) == 3 and "none of 3 calls" in str(e) and len(e.raw) == 2


# ----- Answer with a judge -----
SAMPLE = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 5+7?"}],
          "answer": 12, "verifier": "last_number"}


@pytest.mark.parametrize("reply, weight, reward", [
    ("12", 0.5, 0.5 * 1 + 0.5 * 0.3),  # 0.65
    ("12", 1.0, 0.3),  # the judge alone
    ("12", 0.0, 1.0),  # the rule alone (the judge still runs: its verdict is in info)
    ("11", 0.5, 0.5 * 0 + 0.5 * 0.3),  # 0.15
    ("11", 0.25, 0.75 * 0 + 0.25 * 0.3),  # 0.075
])
def test_answer_mixes_the_rule_score_and_the_judge_score(reply, weight, reward):
    with FakeJudgeServer("Score: 3") as server:
        agent = Answer(judge=Judge(url=server.url, served_model="m"), judge_weight=weight)
        result = run(agent(FakeClient(reply), SAMPLE))
    assert result.reward == pytest.approx(reward)
    assert result.info["answer"] == reply and result.info["rule_score"] == float(reply == "12")
    judged = result.info["judge"]
    assert judged["score"] == pytest.approx(0.3) and judged["raw"] == ["Score: 3"]
    assert "Question:\nWhat is 5+7?" in judged["prompt"] and "Reference answer:\n12" in judged["prompt"]
    assert f"Response:\n{reply}" in judged["prompt"] and "Be brief" not in judged["prompt"]


def test_answer_without_a_judge_is_the_rule_alone():
    result = run(Answer()(FakeClient("It is 12."), SAMPLE))
    assert result.reward == 1.0 and result.info == {"answer": "12"}


def test_a_judge_failure_fails_the_sample_and_is_counted_by_kind():
    client = FakeClient("12")
    with FakeJudgeServer(503, "I decline") as server:
        agent = Answer(judge=Judge(url=server.url, served_model="m"), judge_weight=0.5)
        with pytest.raises(VerifierFailed, match="HTTP 503"):  # what the rollout counts as a failed sample
            run(agent(client, SAMPLE))
        with pytest.raises(JudgeFailed, match="unparsable"):
            run(agent(client, SAMPLE))
    assert client.counts == {"judge_failed/http_error": 1, "judge_failed/unparsable": 1}


def test_the_judge_alone_grades_a_sample_without_a_reference():
    sample = {"messages": [{"role": "user", "content": "Write a haiku."}], "verifier": "exact"}
    with FakeJudgeServer("Verdict: yes") as server:
        agent = Answer(judge=Judge(url=server.url, served_model="m", verdict="yes_no"))
        result = run(agent(FakeClient("an old pond"), sample))
    assert result.reward == 1.0 and result.info["rule_score"] is None and result.info["answer"] is None
    assert "Reference" not in result.info["judge"]["prompt"]


def test_the_sample_log_keeps_the_agents_info(tmp_path):
    from molt_lightning.trajectory import Trajectory

    info = {"answer": "12", "rule_score": 1.0, "judge": {"prompt": "Grade ...", "raw": ["Score: 3"], "score": 0.3},
            "odd": {1, 2}}  # not JSON: written as text
    trainer = SimpleNamespace(global_rank=0, logger=SimpleNamespace(log_dir=str(tmp_path)))
    module = SimpleNamespace(policy_version=1, tokenizer=SimpleNamespace(decode=lambda ids: ""))
    batch = SimpleNamespace(trajectories=[Trajectory(sample_id=3, group_id=0, reward=0.65, info=info)])
    outputs = {"record": SimpleNamespace(batch=batch)}  # the step's record: what the callback reads
    RolloutSamples(every_n_steps=1).on_train_batch_end(trainer, module, outputs, None, 0)
    [line] = [json.loads(x) for x in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert line["info"]["judge"] == info["judge"] and line["info"]["odd"] == "{1, 2}" and line["sample_id"] == 3


# ----- failures that explain themselves -----
def breaker_message(reasons: list[str]) -> str:
    """The failure breaker's stop message (``rollout.source``) after a window of agent runs failed with ``reasons``
    (in turn)."""
    from molt_lightning.config import Rollout
    from molt_lightning.rollout.source import RolloutSource

    source = RolloutSource(Answer(), lambda seed: iter(()), Rollout(group_size=2, prompts_per_step=2))
    for i in range(source.failure_window):
        source._recent.append(reasons[i % len(reasons)])
    source._breaker()
    return str(source._error)


def test_a_401_keeps_its_status_port_and_model_and_the_stop_message_names_the_judge(monkeypatch):
    monkeypatch.setenv("MOLT_TEST_JUDGE_KEY", "sk-wrong")
    with FakeJudgeServer(401) as server:
        judge = Judge(url=server.url, served_model="m", api_key_env="MOLT_TEST_JUDGE_KEY")
        e = failure(Answer(judge=judge)(FakeClient("12"), SAMPLE))
    assert e.kind == "http_error" and "HTTP 401: invalid api key" in str(e)
    assert f"{server.url}/v1/chat/completions (model m)" in str(e)
    judged = f"agent raised {type(e).__name__}: {e}"  # as rollout.agent_run words an agent run that raised
    overflow = "agent raised ContextOverflow: segment of 300 tokens + max_tokens 64 exceeds max_context 256"
    stop = breaker_message([judged] * 3 + [overflow])  # the judge's failures are the most frequent
    assert "JudgeFailed: judge http_error: http://N.N:N/vN/chat/completions (model m) answered HTTP N" in stop
    assert f"(e.g. 'agent raised JudgeFailed: judge http_error: {server.url}/v1/chat/completions (model m) " \
           "answered HTTP 401: invalid api key')" in stop  # each kind beside a real one, numbers kept
    assert "exceeds max_context 256" in stop
    assert f"the judge at {server.url}/v1/chat/completions is what fails: check its url, its key" in stop
    assert "max_context)" not in stop and "served_model" in stop and "timeout_s" in stop
    stop = breaker_message([overflow] * 3 + [judged])  # a short context first: its own fix
    assert "raise model.rollout.max_context" in stop and "is what fails" not in stop and "HTTP 401" in stop
    unparsable = f"agent raised JudgeFailed: {JudgeFailed('unparsable', 'no score in the judge reply')}"
    assert "the judge answers without a verdict" in breaker_message([unparsable])


async def calculator_like(client, sample):  # an agent with no judge
    return 1.0


def test_a_wrong_url_or_key_fails_the_start_check_in_seconds_with_the_fix(monkeypatch):
    port, t0 = closed_port(), time.monotonic()
    with pytest.raises(JudgeFailed) as e:
        check_judges(Answer(judge=Judge(url=f"http://127.0.0.1:{port}", served_model="m")))
    assert time.monotonic() - t0 < 10  # refused: no wait for timeout_s (60 s)
    assert e.value.kind == "http_error" and f"127.0.0.1:{port}" in str(e.value)
    assert "did not answer a test question at the start of the run: check its url" in str(e.value)
    again = pickle.loads(pickle.dumps(e.value))  # what reaches the other ranks
    assert (again.kind, str(again)) == (e.value.kind, str(e.value))
    monkeypatch.setenv("MOLT_TEST_JUDGE_KEY", "sk-wrong")
    with FakeJudgeServer(401) as server, pytest.raises(JudgeFailed, match="HTTP 401") as e:
        Judge(url=server.url, api_key_env="MOLT_TEST_JUDGE_KEY").check()
    assert f":{server.port}/" in str(e.value) and "its key ($MOLT_TEST_JUDGE_KEY)" in str(e.value)
    with FakeJudgeServer("Score: 7") as server:
        judge = Judge(url=server.url)
        assert check_judges(Answer(judge=judge), judge, calculator_like) == 1 and judge.served_model == "judge-model"
        run(judge.grade("Q", "R"))
    assert server.model_lists == 1 and len(server.requests) == 2  # the test question, then the grade
    assert Judge(model=SimpleNamespace(name="judge", model="m")).check() is None  # an Auxiliary: at its first request


def test_a_run_with_an_unreachable_judge_stops_before_the_policy_engine_starts(tmp_path):
    import lightning as L

    from molt_lightning import AsyncRLModule
    from molt_lightning.engines import TorchEngine
    from molt_lightning.tasks.arithmetic import tasks

    class NeverLaunched(TorchEngine):
        def launch(self, *args, **kwargs):
            raise AssertionError("the policy engine started before the judge was asked")

    module = AsyncRLModule(Answer(judge=Judge(url=f"http://127.0.0.1:{closed_port()}", served_model="m")), tasks,
                           engine=NeverLaunched())
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    with pytest.raises(JudgeFailed, match="test question at the start of the run"):
        trainer.fit(module)


def test_a_wait_for_a_slot_is_bounded_and_named_apart():
    with FakeJudgeServer("HANG") as server:
        judge = Judge(url=server.url, served_model="m", max_in_flight=1, slot_timeout_s=0.2, timeout_s=DEADLINE_S)

        async def grades():
            hung = asyncio.create_task(judge.grade("Q", "R1"))  # holds the one slot
            assert await asyncio.to_thread(server.arrived.wait, DEADLINE_S)
            try:
                with pytest.raises(JudgeFailed) as e:
                    await judge.grade("Q", "R2")
                return e.value
            finally:
                hung.cancel()

        e = run(grades())
    assert e.kind == "slot_timeout" and "waited 0.2 s for a free connection slot (1 in use), nothing sent" in str(e)
    assert len(server.requests) == 1


@pytest.mark.slow
def test_timeout_s_counts_from_the_request_being_sent_not_from_the_wait_for_a_slot():
    """400 grades at once through 16 slots: 14 calls hang, 4 answer in 1.8 s (inside timeout_s = 3 s), the others at
    once. The last 2 slow ones are sent after the first 2 slow ones answered: counted from the grade's start, they
    would pass 3 s; and none of the others waits out its timeout for a slot."""
    replies = ["HANG"] * 14 + ["SLOW"] * 2 + ["Score: 6"] * 382 + ["SLOW"] * 2
    with FakeJudgeServer(*replies, slow_s=1.8) as server:
        judge = Judge(url=server.url, served_model="m", timeout_s=3)

        async def grades():
            return await asyncio.gather(*(judge.grade("Q", f"R{i}") for i in range(400)), return_exceptions=True)

        t0 = time.monotonic()
        outs = run(grades())
        print(f"400 grades, 14 hung: {time.monotonic() - t0:.2f} s")
    failed = [o for o in outs if isinstance(o, BaseException)]
    assert len(server.requests) == 400  # every call was sent
    assert len(failed) == 14, [str(f) for f in failed[:3]]
    assert all(f.kind == "timeout" and "within 3 s of the request being sent" in str(f) for f in failed)
    assert all(o.score == pytest.approx(0.6) for o in outs if not isinstance(o, BaseException))


def test_one_model_list_request_serves_every_slot():
    with FakeJudgeServer("Score: 6", models_s=0.2) as server:
        judge = Judge(url=server.url)  # no served_model: the first of /v1/models

        async def grades():
            await asyncio.gather(*(judge.grade("Q", f"R{i}") for i in range(32)))
            await judge.grade("Q", "once more")

        run(grades())
    assert server.model_lists == 1 and len(server.requests) == 33
    assert {b["model"] for b in server.requests} == {"judge-model"}


@pytest.mark.slow
def test_a_recipe_builds_the_judge(tmp_path, monkeypatch):
    """The YAML of docs/workflow.md's judge section, through molt's LightningCLI: an Answer holding a Judge on an
    Auxiliary, and one at a URL."""
    from molt_lightning import AsyncRLModule
    from molt_lightning.commands.cli import MoltParser, molt_cli
    from molt_lightning.engines import Auxiliary, TorchEngine

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "What is 5+7?", "answer": 12}) + "\n")
    recipe = tmp_path / "judge.yaml"
    for judge, check in [("{model: {class_path: molt_lightning.engines.Auxiliary, init_args: "
                          "{model: molt_lightning.models.tiny.arithmetic_policy, name: judge, "
                          "engine: molt_lightning.engines.TorchEngine}}, verdict: yes_no}",
                          lambda j: isinstance(j.model, Auxiliary) and isinstance(j.model.engine, TorchEngine)
                          and j.model.name == "judge" and j.model.folder is None),  # not started: at first use
                         ("{url: 'http://127.0.0.1:8000', served_model: judge, samples: 3, temperature: 0.7}",
                          lambda j: j.endpoint == "http://127.0.0.1:8000/v1/chat/completions" and j.samples == 3)]:
        recipe.write_text(f"""
model:
  engine: molt_lightning.engines.TorchEngine
  tasks:
    class_path: molt_lightning.data.Tasks
    init_args: {{sources: [{{path: {tmp_path}/train.jsonl, prompt: question, verifier: last_number}}]}}
  agent:
    class_path: molt_lightning.agents.Answer
    init_args:
      max_tokens: 8
      judge_weight: 0.5
      judge: {{class_path: molt_lightning.data.judge.Judge, init_args: {judge}}}
trainer: {{logger: false}}
""")
        cli = molt_cli()(AsyncRLModule, run=False, args=["--config", str(recipe)], parser_class=MoltParser,
                         auto_configure_optimizers=False)
        agent = cli.model.source.agent
        assert isinstance(agent, Answer) and agent.judge_weight == 0.5 and check(agent.judge), agent.judge


@pytest.mark.slow
def test_a_judge_on_an_auxiliary_engine(policy_path):
    """The tiny arithmetic policy as the judge: it answers "ANSWER <digits>", so a yes/no judge finds no verdict
    (unparsable, its reply kept) and a score judge reads the digits; the auxiliary counts both requests."""
    from molt_lightning.engines import Auxiliary, TorchEngine

    aux = Auxiliary(model=policy_path, engine=TorchEngine(seed=0), name="judge")
    try:
        yes_no = Judge(model=aux, verdict="yes_no", max_tokens=8)
        e = failure(yes_no.grade("What is 3+4?", "7", 7))
        assert e.kind == "unparsable" and len(e.raw) == 1 and e.raw[0].strip() and "What is 3+4?" in e.prompt
        verdict = run(Judge(model=aux, verdict="score:0-100000", max_tokens=8).grade("What is 3+4?", "7", 7))
        assert 0 <= verdict.score <= 1 and verdict.raw[0].strip()
        metrics = aux.take_metrics()
        assert metrics["judge/requests"] == 2 and metrics["judge/failures"] == 0 and metrics["judge/tokens"] > 0
    finally:
        aux.stop()
