"""Bad input through the run's endpoint is always answered, never trained on (hypothesis).

One endpoint in front of the torch engine and the tiny python-tool policy serves the whole module, on a real loopback
socket; raw HTTP reaches it. Every route gets random bytes, truncated and non-UTF-8 JSON, random JSON values, bodies
past the size limit, and requests that are valid except for one field (a wrong type, a value the run cannot honour,
an unknown field, garbage nested inside messages, tools or blocks). Each must be answered with a 4xx in its wire's
error shape that names the field (413 for a body past the limit), over a connection that stays usable. After the
fuzzing the same server still answers the stock OpenAI and Anthropic clients, and the trajectory the bad requests
were sent for holds exactly what its one valid request made: no token, span, segment break or engine call came from
a refused request, and each refusal was counted.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
from collections import Counter
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from molt_lightning.agents.client import AgentClient
from molt_lightning.agents.sessions import AgentSessions
from molt_lightning.agents.wire.endpoint import Endpoint
from molt_lightning.tasks import python_tool
from molt_lightning.trajectory import Trajectory

LIMIT = 64 << 10  # this module's body limit (the default is Endpoint.MAX_BODY): huge bodies stay cheap to send
pytestmark = pytest.mark.slow  # about 1,000 requests, and its last test checks what the others left (the whole module)
CONTEXT = 256
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CHAT, MESSAGES = "/v1/chat/completions", "/v1/messages"
OPENAI = {"model": "policy", "max_tokens": 4, "tools": python_tool.TOOLS, "messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 12*34?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "python", "arguments": '{"code": "print(12*34)"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "408"}]}
ANTHROPIC = {"model": "policy", "max_tokens": 4, "system": "Be brief.", "tools": python_tool.ANTHROPIC_TOOLS,
             "messages": [
                 {"role": "user", "content": "What is 12*34?"},
                 {"role": "assistant", "content": [{"type": "text", "text": "Let me run it."}, {
                     "type": "tool_use", "id": "toolu_1", "name": "python", "input": {"code": "print(12*34)"}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "408"}]}]}


class Served:
    """The module's endpoint, the client the bad requests are sent for (``fuzz``), one whose requests may be valid
    (``loose``), and what they have seen."""

    def __init__(self, clients: AgentSessions, fuzz: AgentClient, loose: AgentClient, counts: Counter,
                 generations: list):
        self.clients, self.endpoint, self.fuzz, self.loose = clients, clients.endpoint, fuzz, loose
        self.counts, self.generations = counts, generations
        self.host, port = self.endpoint.root_url.removeprefix("http://").split(":")
        self.port, self.record, self.refused, self.loose_answered = int(port), None, 0, 0
        self.local, self.lock, self.connections = threading.local(), threading.Lock(), []

    def send(self, method: str, path: str, body: bytes | None = None, key: str | None = "", headers=None,
             chunked: bool = False) -> tuple[int, dict]:
        """One request on this thread's kept-alive connection (reopened only when the server said ``Connection:
        close``); the status and the JSON it answered. A dropped connection or an answer that is no JSON fails the
        test. ``key``: the fuzzed trajectory's by default, None for none."""
        if getattr(self.local, "conn", None) is None:
            self.local.conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
            with self.lock:
                self.connections.append(self.local.conn)
        key = self.fuzz.api_key if key == "" else key
        sent = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {}),
                **(headers or {})}
        conn = self.local.conn
        if chunked:  # no Content-Length: the body streams in and the limit must hold as it arrives
            conn.request(method, path, body=iter([body[i:i + 8192] for i in range(0, len(body), 8192)]),
                         headers=sent, encode_chunked=True)
        else:
            conn.request(method, path, body=body, headers=sent)
        response = conn.getresponse()
        data = response.read()
        if response.getheader("connection", "").lower() == "close":
            conn.close()
            self.local.conn = None
        with self.lock:
            if method == "POST" and path in (CHAT, MESSAGES):
                self.refused += response.status != 200 and key == self.fuzz.api_key
                self.loose_answered += response.status == 200 and key == self.loose.api_key
        return response.status, json.loads(data)


@pytest.fixture(scope="module")
def served():
    from transformers import AutoTokenizer

    from molt_lightning.engines import TorchEngine
    from molt_lightning.models.tiny import python_tool_policy

    path = python_tool_policy()
    engine = TorchEngine(seed=0)
    engine.launch(path)
    generations, generate = [], engine.generate

    async def counted(*args, **kwargs):  # every engine call, whoever made it
        generations.append(args[0])
        return await generate(*args, **kwargs)

    engine.generate = counted
    clients = AgentSessions(engine, path, AutoTokenizer.from_pretrained(path), 1.0, CONTEXT)
    clients.endpoint.max_body = LIMIT
    clients.start()  # uvicorn configures its loggers here: the handler goes on after
    errors = _ServerErrors()
    for name in ("uvicorn.error", "starlette"):
        logging.getLogger(name).addHandler(errors)
    counts = Counter()
    fuzz = AgentClient(engine, Trajectory(0, 0), clients.template, 1.0, CONTEXT, seed=0,
                       counter=lambda name, n: counts.update({name: n}))
    loose = AgentClient(engine, Trajectory(3, 0), clients.template, 1.0, CONTEXT, seed=3)
    fuzz.attach(clients.endpoint, "fuzz")
    loose.attach(clients.endpoint, "loose")
    out = Served(clients, fuzz, loose, counts, generations)
    try:
        yield out
    finally:
        for name in ("uvicorn.error", "starlette"):
            logging.getLogger(name).removeHandler(errors)
        for conn in out.connections:
            conn.close()
        clients.stop()
        engine.release()
    assert not errors.records, f"the server logged errors: {errors.records[:3]}"


class _ServerErrors(logging.Handler):
    """Errors the server logs (an exception in the ASGI app, a protocol failure)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records = []

    def emit(self, record):
        self.records.append(self.format(record))


def check_refused(served: Served, path: str, status: int, answer: dict, field: str | None = None,
                  statuses=(400,)) -> str:
    """A refusal in the route's wire shape, with the expected status, naming ``field``; returns its message."""
    assert status in statuses, (status, answer)
    if path == MESSAGES:
        assert answer["type"] == "error" and set(answer["error"]) == {"type", "message"}, answer
        message = answer["error"]["message"]
    else:
        assert set(answer["error"]) == {"message", "type", "param", "code"}, answer
        message = answer["error"]["message"]
    assert isinstance(message, str) and 10 < len(message) < 1000, message
    if field is not None:
        assert field in message, (field, message)
    return message


# ----- strategies -----
leaves = (st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.integers(10 ** 20, 10 ** 300)
          | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def wrong(ok):
    """A JSON value that is present (not null) and fails ``ok``."""
    return values.filter(lambda v: v is not None and not ok(v))


not_str, not_bool, not_obj = (wrong(lambda v: isinstance(v, str)), wrong(lambda v: isinstance(v, bool)),
                              wrong(lambda v: isinstance(v, dict)))
not_list = wrong(lambda v: isinstance(v, list))
bad_max_tokens = wrong(lambda v: is_int(v) and 1 <= v < CONTEXT) | st.integers(-(2 ** 64), 0) \
    | st.integers(CONTEXT, 10 ** 40)
bad_sampling = wrong(lambda v: is_number(v) and abs(v - 1) <= 1e-6) | st.floats(-5, 5).filter(
    lambda v: abs(v - 1) > 1e-6)
lone_surrogates = st.tuples(st.integers(0xD800, 0xDFFF), st.integers(0xDC00, 0xDFFF)).map(  # never high+low
    lambda cs: f"text {chr(cs[0])} {chr(cs[1])}")
not_text = wrong(lambda v: isinstance(v, (str, list)))
bad_parts = st.lists(wrong(lambda v: isinstance(v, dict)) | st.fixed_dictionaries(
    {"type": st.text(max_size=8).filter(lambda t: t != "text")}) | st.fixed_dictionaries(
    {"type": st.just("text"), "text": not_str}), min_size=1, max_size=3)
bad_choice = values.filter(lambda v: v not in (None, "auto", "none"))
not_json_object = st.text(max_size=20).filter(lambda s: s.strip() and not _is_object_text(s)) | wrong(
    lambda v: isinstance(v, (str, dict)))


def _is_object_text(s):
    try:
        return isinstance(json.loads(s), dict)
    except ValueError:
        return False


def unknown_key(known):
    return st.text(min_size=1, max_size=20).filter(lambda k: k not in known)


# (path into the base request, wrong values, what the message must name); each makes exactly one thing wrong
OPENAI_MUTATIONS = [
    (("model",), not_str, "model"),
    (("messages",), not_list | st.just([]), "messages"),
    *[(("messages", i), not_obj, f"messages[{i}]") for i in range(4)],
    *[(("messages", i, "role"), values.filter(
        lambda v: v not in ("system", "developer", "user", "assistant", "tool")), f"messages[{i}].role")
      for i in range(4)],
    (("messages", 1, "content"), not_text | st.none() | bad_parts | lone_surrogates, "messages[1].content"),
    (("messages", 3, "content"), not_text | bad_parts, "messages[3].content"),
    (("messages", 2, "tool_calls"), not_list | st.lists(not_obj, min_size=1, max_size=2), "messages[2].tool_calls"),
    (("messages", 2, "tool_calls", 0, "function"), not_obj | st.fixed_dictionaries({"name": not_str}),
     "messages[2].tool_calls[0]"),
    (("messages", 2, "tool_calls", 0, "function", "arguments"), not_json_object,
     "messages[2].tool_calls[0].function.arguments"),
    (("tools",), not_list | st.lists(not_obj, min_size=1, max_size=2), "tools"),
    (("tools", 0, "function"), not_obj | st.fixed_dictionaries({"name": not_str | st.just("")}), "tools[0]"),
    (("tools", 0, "function", "parameters"), not_obj, "tools[0]"),
    (("tool_choice",), bad_choice, "tool_choice"),
    (("max_tokens",), bad_max_tokens, "max_tokens"),
    (("max_completion_tokens",), bad_max_tokens, "max_completion_tokens"),
    (("n",), values.filter(lambda v: v is not None and not (is_int(v) and v == 1)), "n"),
    (("stream",), not_bool, "stream"),
    (("temperature",), bad_sampling, "temperature"),
    (("top_p",), bad_sampling, "top_p"),
    (("logprobs",), not_bool | st.just(True), "logprobs"),
    (("frequency_penalty",), wrong(lambda v: is_number(v) and v == 0), "frequency_penalty"),
    (("presence_penalty",), wrong(lambda v: is_number(v) and v == 0), "presence_penalty"),
    *[((name,), not_str, name) for name in ("user", "service_tier", "prompt_cache_key", "safety_identifier")],
    *[((name,), not_obj, name) for name in ("metadata", "stream_options")],
    *[((name,), not_bool, name) for name in ("parallel_tool_calls", "store")],
    (("seed",), wrong(is_int), "seed"),
]
ANTHROPIC_MUTATIONS = [
    (("model",), not_str, "model"),
    (("messages",), not_list | st.just([]), "messages"),
    *[(("messages", i), not_obj, f"messages[{i}]") for i in range(3)],
    *[(("messages", i, "role"), values.filter(lambda v: v not in ("user", "assistant")), f"messages[{i}].role")
      for i in range(3)],
    (("messages", 0, "content"), not_text | st.none() | bad_parts | lone_surrogates, "messages[0].content"),
    (("messages", 1, "content", 0), not_obj | st.fixed_dictionaries(
        {"type": st.sampled_from(["image", "document", "tool_result", "thinking", "server_tool_use", 5, None])}),
     "messages[1].content[0]"),
    (("messages", 1, "content", 0, "text"), not_str, "messages[1].content[0].text"),
    (("messages", 1, "content", 1, "input"), not_obj, "messages[1].content[1].input"),
    (("messages", 1, "content", 1, "name"), not_str, "messages[1].content[1].name"),
    (("messages", 2, "content", 0, "content"), not_text | bad_parts, "messages[2].content[0].content"),
    (("system",), not_text | bad_parts, "system"),
    (("tools",), not_list | st.lists(not_obj, min_size=1, max_size=2), "tools"),
    (("tools", 0, "input_schema"), not_obj, "tools[0]"),
    (("tools", 0, "name"), not_str | st.just(""), "tools[0]"),
    (("tools", 0, "type"), st.text(min_size=1, max_size=20).filter(lambda t: t != "custom"), "tools[0]"),
    (("tool_choice",), bad_choice.filter(lambda v: not (isinstance(v, dict) and v.get("type") in ("auto", "none")))
     | st.fixed_dictionaries({"type": st.sampled_from(["any", "tool", None, 5])}), "tool_choice"),
    (("max_tokens",), bad_max_tokens, "max_tokens"),
    (("temperature",), bad_sampling, "temperature"),
    (("top_p",), bad_sampling, "top_p"),
    (("top_k",), values.filter(lambda v: v is not None), "top_k"),
    (("stop_sequences",), not_list | st.lists(st.text(max_size=4), min_size=1, max_size=2), "stop_sequences"),
    (("stream",), not_bool, "stream"),
    (("thinking",), not_obj | st.fixed_dictionaries({"type": values.filter(
        lambda v: v not in ("disabled", "adaptive"))}), "thinking"),
    (("output_config",), not_obj | st.fixed_dictionaries({"format": values.filter(bool)}), "output_config"),
    (("metadata",), not_obj, "metadata"),
    *[((name,), not_str, name) for name in ("service_tier", "speed", "inference_geo", "workspace_id")],
]


def mutate(base: dict, path: tuple, value):
    body = json.loads(json.dumps(base))
    *parents, last = path
    node = body
    for step in parents:
        node = node[step]
    node[last] = value
    return body


def field_of(path: tuple) -> str:
    return path[0] + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path[1:])


def one_wrong_field(base, mutations):
    return st.sampled_from(mutations).flatmap(
        lambda m: st.tuples(st.just(m[0]), m[1], st.just(m[2])).map(lambda t: (mutate(base, t[0], t[1]), t[2])))


def unknown_field(base, known):
    return st.tuples(unknown_key(known), values).map(lambda kv: ({**base, kv[0]: kv[1]}, kv[0]))


def raw_bodies(base: dict):
    """Bytes that are no JSON object: random bytes, truncated or mangled JSON, non-UTF-8, empty, too deep."""
    text = json.dumps(base).encode()
    return st.one_of(
        st.binary(max_size=64),
        st.integers(0, len(text) - 1).map(lambda n: text[:n]),  # truncated
        st.tuples(st.integers(0, len(text) - 1), st.binary(min_size=1, max_size=4).filter(_not_utf8)).map(
            lambda t: text[:t[0]] + t[1] + text[t[0]:]),  # a non-UTF-8 byte sequence spliced in
        st.sampled_from([b"", b"   ", b"null", b"[]", b'"policy"', b"1e999", b"NaN", b"\xef\xbb\xbf{}"]),
        st.integers(1200, 30_000).map(lambda n: b"[" * n + b"]" * n),  # nested past the parser's limit
        st.sampled_from([b"Infinity", b"-Infinity", b"NaN", b"1e999"]).map(  # numbers JSON does not have
            lambda c: text[:-1] + b', "temperature": ' + c + b"}"),
        values.map(lambda v: json.dumps(v).encode()).filter(lambda b: not b.startswith(b"{")),
    )


def _not_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


# ----- the tests -----
def test_the_base_requests_are_valid(served):
    """The bases every mutation starts from are answered (by another trajectory: the fuzzed one stays empty until
    its one valid turn); the fuzzed trajectory then takes its one valid turn, the record checked at the end."""
    other = AgentClient(served.fuzz.engine, Trajectory(1, 0), served.clients.template, 1.0, CONTEXT, seed=1)
    other.attach(served.endpoint, "base")
    for path, base in ((CHAT, OPENAI), (MESSAGES, ANTHROPIC)):
        status, answer = served.send("POST", path, json.dumps(base).encode(), key=other.api_key)
        assert status == 200, answer
    other.detach()
    assert other.trajectory.num_policy_tokens > 0 and "endpoint_errors" not in other.trajectory.info
    status, answer = served.send("POST", CHAT, json.dumps(OPENAI).encode())
    assert status == 200 and answer["choices"][0]["message"]["role"] == "assistant", answer
    fuzz = served.fuzz.trajectory
    served.record = (json.dumps([[(s.kind, s.token_ids, s.logprobs, s.versions) for s in seg]
                                 for seg in fuzz.segments]), fuzz.turns, fuzz.status,
                     len(served.generations) - served.loose_answered)


@FUZZ
@given(st.sampled_from([CHAT, MESSAGES]).flatmap(
    lambda p: st.tuples(st.just(p), raw_bodies(OPENAI if p == CHAT else ANTHROPIC))))
def test_bytes_that_are_no_json_object_are_refused(served, case):
    path, raw = case
    status, answer = served.send("POST", path, raw)
    message = check_refused(served, path, status, answer, statuses=(400, 404))
    assert "JSON" in message or "body" in message or "model" in message, message


@settings(FUZZ, max_examples=250)
@given(one_wrong_field(OPENAI, OPENAI_MUTATIONS))
def test_one_wrong_field_of_a_chat_completion_is_refused_by_name(served, case):
    body, field = case
    status, answer = served.send("POST", CHAT, json.dumps(body).encode())
    check_refused(served, CHAT, status, answer, field, statuses=(400, 404) if field == "model" else (400,))


@settings(FUZZ, max_examples=250)
@given(one_wrong_field(ANTHROPIC, ANTHROPIC_MUTATIONS))
def test_one_wrong_field_of_an_anthropic_message_is_refused_by_name(served, case):
    body, field = case
    status, answer = served.send("POST", MESSAGES, json.dumps(body).encode())
    check_refused(served, MESSAGES, status, answer, field, statuses=(400, 404) if field == "model" else (400,))


@FUZZ
@given(st.sampled_from([(CHAT, OPENAI), (MESSAGES, ANTHROPIC)]).flatmap(
    lambda pb: st.tuples(st.just(pb[0]), unknown_field(pb[1], set(pb[1]) | _known(pb[0])))))
def test_unknown_fields_are_refused_by_name(served, case):
    path, (body, key) = case
    status, answer = served.send("POST", path, json.dumps(body).encode())
    message = check_refused(served, path, status, answer)
    assert repr(key)[:40] in message or key[:40] in message, (key, message)
    if path == CHAT:
        assert answer["error"]["code"] == "unsupported_parameter" and answer["error"]["param"] == key


def _known(path):
    from molt_lightning.agents.wire import anthropic_messages, openai_chat

    return set(openai_chat._FIELDS if path == CHAT else anthropic_messages._FIELDS)


@FUZZ
@given(st.sampled_from([CHAT, MESSAGES]), values, st.sampled_from(["messages", "tools", "system", "metadata",
                                                                    "tool_choice", "content"]))
def test_random_json_in_a_field_is_answered(served, path, garbage, where):
    """Random JSON in a field, or nested in a message: a value the field takes makes a valid request (answered 200;
    sent for another trajectory, which the last test checks holds exactly one turn per 200), anything else is
    refused with a 400."""
    body = json.loads(json.dumps(OPENAI if path == CHAT else ANTHROPIC))
    if where == "content":
        body["messages"][1 if path == CHAT else 0]["content"] = garbage
    elif path == CHAT and where == "system":
        body["messages"][0]["content"] = garbage
    else:
        body[where] = garbage
    status, answer = served.send("POST", path, json.dumps(body).encode(), key=served.loose.api_key)
    if status == 200:
        assert answer["role" if path == MESSAGES else "object"] in ("assistant", "chat.completion"), answer
    else:
        check_refused(served, path, status, answer, statuses=(400,))


@settings(FUZZ, max_examples=30)
@given(st.sampled_from([CHAT, MESSAGES]), st.integers(LIMIT + 1, 8 * LIMIT), st.booleans(), st.booleans())
def test_bodies_past_the_limit_get_413(served, path, size, as_json, chunked):
    if as_json:  # a plausible request with one huge message
        body = {**(OPENAI if path == CHAT else ANTHROPIC)}
        body["messages"] = [{"role": "user", "content": "x" * size}]
        raw = json.dumps(body).encode()
    else:
        raw = b"\xff" * size
    status, answer = served.send("POST", path, raw, chunked=chunked)
    message = check_refused(served, path, status, answer, statuses=(413,))
    assert f"{LIMIT:,}" in message and "limit" in message


def test_the_default_limit_is_a_few_megabytes(served):
    """The default (4 MiB) refuses a body one byte past it with 413; one of exactly the limit is read and answered
    (here: refused for its unknown field, whose 4 MiB value the message does not echo)."""
    assert Endpoint.MAX_BODY == 4 << 20
    served.endpoint.max_body = Endpoint.MAX_BODY
    try:
        empty = len(json.dumps({**OPENAI, "padding": ""}).encode())
        for size, expect in ((Endpoint.MAX_BODY + 1, 413), (Endpoint.MAX_BODY, 400)):
            raw = json.dumps({**OPENAI, "padding": "x" * (size - empty)}).encode()
            assert len(raw) == size
            status, answer = served.send("POST", CHAT, raw)
            assert status == expect and len(answer["error"]["message"]) < 1000, answer
        assert answer["error"]["code"] == "unsupported_parameter" and answer["error"]["param"] == "padding"
    finally:
        served.endpoint.max_body = LIMIT


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
def test_a_conversation_that_cannot_fit_is_refused_before_it_is_rendered(served, path):
    """3 MB of tool result under the 4 MiB limit: refused by its length alone (at least characters / longest token),
    not after rendering and tokenizing it on the engine's loop (seconds, while every agent of the run waits)."""
    served.endpoint.max_body = Endpoint.MAX_BODY
    try:
        body = json.loads(json.dumps(OPENAI if path == CHAT else ANTHROPIC))
        huge = "408 " * (3 << 18)
        if path == CHAT:
            body["messages"][3]["content"] = huge
        else:
            body["messages"][2]["content"][0]["content"] = huge
        status, answer = served.send("POST", path, json.dumps(body).encode())
    finally:
        served.endpoint.max_body = LIMIT
    message = check_refused(served, path, status, answer)
    assert "at least" in message and "context" in message


@FUZZ
@given(st.sampled_from([CHAT, MESSAGES]), st.one_of(st.none(), st.text(
    st.characters(min_codepoint=33, max_codepoint=126), max_size=30)), st.binary(max_size=200))
def test_an_unknown_key_is_refused_whatever_the_body(served, path, key, raw):
    status, answer = served.send("POST", path, raw, key=key or None)
    check_refused(served, path, status, answer, statuses=(401,))


@FUZZ
@given(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
       st.sampled_from([CHAT, MESSAGES, "/v1/models", "/v1/completions", "/v1/embeddings", "/v1/responses",
                        "/v1/messages/count_tokens", "/", "/v1"]) | st.text(max_size=30).map(
           lambda t: "/" + quote(t, safe="/")),
       st.binary(max_size=100))
def test_every_route_and_method_is_answered(served, method, path, raw):
    """Each route answers each method: the routes it serves as they do, anything else 404/405 as a JSON error in the
    wire's shape (never a bare text page)."""
    status, answer = served.send(method, path, raw if method != "GET" else None)
    if method == "GET" and path == "/v1/models":
        assert status == 200 and [m["id"] for m in answer["data"]] == served.endpoint.model_names
    elif method == "GET" and path.startswith("/v1/models/"):
        name = path.removeprefix("/v1/models/")
        assert (status, answer.get("id")) == (200, name) if name in served.endpoint.model_names else status == 404
    elif method == "POST" and path in (CHAT, MESSAGES):
        check_refused(served, path, status, answer, statuses=(400, 404))
    else:
        check_refused(served, MESSAGES if path.startswith(MESSAGES) else CHAT, status, answer, statuses=(404, 405))


def test_bad_and_good_requests_at_once(served):
    """Bad requests from 8 connections at once, beside valid ones from another trajectory: each bad one refused, each
    valid one answered (the valid ones wait for each other on the trajectory's lock, not for the bad ones)."""
    from concurrent.futures import ThreadPoolExecutor

    bad = [json.dumps(mutate(OPENAI, ("messages", 1, "content"), 5)).encode(), b"{", b"\xff" * 100,
           json.dumps({**ANTHROPIC, "top_k": 3}).encode()]
    jobs = [(CHAT if i % 4 != 3 else MESSAGES, bad[i % 4], "") for i in range(40)]
    jobs[5::10] = [(CHAT, json.dumps({**OPENAI, "messages": OPENAI["messages"][:2]}).encode(), served.loose.api_key)
                   for _ in jobs[5::10]]

    with ThreadPoolExecutor(8) as pool:  # each thread its own connection
        results = list(pool.map(lambda job: served.send("POST", job[0], job[1], key=job[2]), jobs))
    for (path, _, key), (status, answer) in zip(jobs, results):
        if key:
            assert status == 200 and answer["object"] == "chat.completion", answer
        else:
            check_refused(served, path, status, answer)
    assert sum(1 for job in jobs if job[2]) == 4


def test_malformed_http_is_answered(served):
    """HTTP the server cannot parse is answered 400 by uvicorn itself (plain text), and the server goes on."""
    import socket

    for raw in (b"GARBAGE\r\n\r\n", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
                b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n"):
        with socket.create_connection((served.host, served.port), timeout=30) as sock:
            sock.sendall(raw)
            answer = b""
            while chunk := sock.recv(4096):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 400 "), answer
    status, answer = served.send("GET", "/v1/models")
    assert status == 200 and answer["object"] == "list"


def test_the_server_still_answers_and_nothing_refused_was_recorded(served):
    """After all of the above: the stock clients get replies from the same server, the fuzzed trajectory holds
    exactly its one valid turn, every refusal of it was counted, and the engine ran only for valid requests."""
    import anthropic

    assert served.record is not None, "run the whole module: test_the_base_requests_are_valid records the baseline"
    fuzz = served.fuzz.trajectory
    record = (json.dumps([[(s.kind, s.token_ids, s.logprobs, s.versions) for s in seg] for seg in fuzz.segments]),
              fuzz.turns, fuzz.status, len(served.generations) - served.loose_answered)
    assert record == served.record, "a refused request left a trace in the trajectory or ran the engine"
    assert sum(n for name, n in served.counts.items() if name.startswith("endpoint_error/")) == served.refused > 300
    assert len(fuzz.info["endpoint_errors"]) == 100  # kept per trajectory; the counter has them all
    assert not served.endpoint._task.done()

    after = AgentClient(served.fuzz.engine, Trajectory(2, 0), served.clients.template, 1.0, CONTEXT, seed=2)
    after.attach(served.endpoint, "after")

    async def ask():
        openai_reply = await after.openai().chat.completions.create(model="policy", messages=OPENAI["messages"],
                                                                    tools=python_tool.TOOLS, max_tokens=4)
        llm = anthropic.AsyncAnthropic(base_url=after.anthropic_base_url, api_key=after.api_key, max_retries=0)
        async with llm:
            anthropic_reply = await llm.messages.create(model="policy", messages=[
                {"role": "user", "content": "What is 2+3?"}], max_tokens=4)
        return openai_reply, anthropic_reply

    openai_reply, anthropic_reply = served.fuzz.engine.call(ask(), timeout=120)
    assert openai_reply.choices[0].message.role == "assistant" and anthropic_reply.type == "message"
    loose = served.loose.trajectory  # random JSON in a field: one turn, one policy span per request answered 200
    assert loose.turns == len(list(loose.policy_spans())) == served.loose_answered
    assert len(served.generations) == served.record[3] + served.loose_answered + 2 and after.trajectory.turns == 2
    after.detach()
