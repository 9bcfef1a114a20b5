"""What both wires of the endpoint share: the request error (rendered in each wire's own shape), the type checks of a
request's fields, and the checks of sampling settings, ``max_tokens`` and tools. Kept apart so that
``openai_chat`` and ``anthropic_messages`` both import it; each check takes what it reads (a value, the run's
context), never the session.

Every check names the field (``messages[2].content``) and the fix, and quotes the value it got cut to a few dozen
characters (a 4 MB value is not echoed back, nor kept in the trajectory's ``endpoint_errors``)."""

from __future__ import annotations

import json
import math
import re
from typing import Any


class RequestError(Exception):
    """A request the endpoint refuses, with the OpenAI error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def refuse(message: str, param: str, code: str = "unsupported_value") -> RequestError:
    """A 400 for what the endpoint does not support (by default a value that would change sampling)."""
    return RequestError(400, message, param, code)


def short(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (error messages quote what they got, never all of it)."""
    try:
        text = repr(value)
    except RecursionError:
        text = f"<{type(value).__name__} nested too deeply>"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_IS = {"a string": lambda v: isinstance(v, str), "a boolean": lambda v: isinstance(v, bool), "an integer": is_int,
       "a number": is_number, "an object": lambda v: isinstance(v, dict), "a list": lambda v: isinstance(v, list),
       "any JSON value": lambda v: True}


def need(ok: bool, where: str, what: str, value: Any, fix: str = "") -> None:
    """Refuse ``value`` at ``where`` unless ``ok``: "<where> must be <what>, got <value>[: <fix>]"."""
    if not ok:
        raise RequestError(400, f"{where} must be {what}, got {short(value)}" + (f": {fix}" if fix else ""), where,
                           "invalid_type")


def check_fields(body: dict, fields: dict[str, str], why: str) -> None:
    """Refuse fields not in ``fields`` (``why``: why unknown fields are refused) and present, non-null fields of the
    wrong type (``fields`` maps each name to its type, a key of ``_IS``)."""
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise RequestError(400, f"unsupported parameter(s) {short(unknown, 120)}: {why}; remove them",
                           unknown[0][:100], "unsupported_parameter")
    for name, kind in fields.items():
        value = body.get(name)
        need(value is None or _IS[kind](value), name, kind, value, "fix its type or omit it")


def text_of(content: Any, where: str, parts: str) -> str:
    """A string, or a list of text parts (``{"type": "text", "text": str}``) joined; anything else is refused, images
    and other non-text parts as ``unsupported_content``. ``parts`` names what a part is on this wire."""
    if isinstance(content, str):
        return content
    need(isinstance(content, list), where, f"a string or a list of {parts}", content)
    out = []
    for j, part in enumerate(content):
        need(isinstance(part, dict), f"{where}[{j}]", "an object like {'type': 'text', 'text': '...'}", part)
        if part.get("type") != "text":
            raise RequestError(400, f"{where}[{j}]: only text {parts} are supported (no images, audio or documents), "
                                    f"got type {short(part.get('type'))}", f"{where}[{j}]", "unsupported_content")
        need(isinstance(part.get("text"), str), f"{where}[{j}].text", "a string", part.get("text"))
        out.append(part["text"])
    return "".join(out)


def check_sampling(body: dict, temperature: float, top_p: float = 1.0) -> None:
    """Refuse a temperature or top_p other than the run's (both wires): the trainer computes logprobs under the run's
    sampling distribution, so another one would make its importance weights wrong."""
    for name, run_value in (("temperature", temperature), ("top_p", top_p)):
        value = body.get(name)
        if value is None:
            continue
        need(is_number(value), name, "a number", value, f"omit it (the run samples at {name}={run_value})")
        # an int compares exactly (10**400 has no float); `not <=` refuses NaN too
        differs = value != run_value if isinstance(value, int) else not abs(value - run_value) <= 1e-6
        if differs:
            raise refuse(f"{name}={short(value)} differs from the run's {run_value}: the trainer computes logprobs "
                         f"under the run's sampling distribution; omit {name}", name)


def check_max_tokens(value: Any, name: str, context: int) -> int | None:
    """A positive integer below ``context`` (the run's max_context), or None (the rest of the context)."""
    need(value is None or (is_int(value) and value >= 1), name, "a positive integer", value,
         "omit it for the rest of the context")
    if value is not None and value >= context:
        raise RequestError(400, f"{name}={short(value)} leaves no room for the prompt in this run's context of "
                                f"{context} tokens: ask for fewer, or omit {name} (the rest of the context)", name,
                           "context_length_exceeded")
    return value


def check_tools(tools: Any, choice: Any, tools_ok: bool) -> list | None:
    """OpenAI-style function tools, or None (none given, or ``tool_choice`` none); refused unless the policy can
    take them (``tools_ok``)."""
    if choice not in (None, "auto", "none"):
        raise refuse(f"tool_choice={short(choice)} is not supported (it needs constrained decoding); use 'auto' or "
                     "'none'", "tool_choice")
    if tools is None or choice == "none":
        return None
    need(isinstance(tools, list), "tools", "a list of {'type': 'function', 'function': {...}}", tools)
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str) or not fn["name"]
                or not isinstance(fn.get("description", ""), (str, type(None)))
                or not isinstance(fn.get("parameters", {}), dict)):
            raise RequestError(400, f"tools[{i}] is malformed ({short(tool)}): expected {{'type': 'function', "
                                    "'function': {'name': str, 'description': str, 'parameters': JSON schema "
                                    "object}}", f"tools[{i}]", "invalid_tool_schema")
    if tools and not tools_ok:
        raise RequestError(400, "this policy cannot take tools: its chat template does not render `tools` or its "
                                "tokenizer has no `response_template` to parse tool calls (transformers' "
                                "parse_response); add both to its tokenizer_config.json", "tools",
                           "tools_not_supported")
    return tools or None


def lone_surrogate(value: Any) -> str | None:
    """Where a string of ``value`` holds a lone UTF-16 surrogate (JSON's ``"\\ud800"``: no Unicode text, and the
    tokenizer cannot take it), e.g. ``messages[0].content``; None if nowhere."""
    stack = [(value, "")]
    while stack:
        v, where = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return where or "the body"
        elif isinstance(v, dict):
            stack += [(x, f"{where}.{k}" if where else str(k)) for k, x in v.items()] + [(k, where) for k in v]
        elif isinstance(v, list):
            stack += [(x, f"{where}[{i}]") for i, x in enumerate(v)]
    return None


_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")  # a JSON escape of a UTF-16 surrogate (paired, or a lone one)


def _finite(text: str) -> float:
    """A JSON number, refused past a float's range (``1e999``), and JSON's missing constants (``NaN``, ``Infinity``)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is not a finite number: use finite numbers")
    return value


def json_object(raw: bytes) -> dict:
    """The request body as a JSON object; refused (400) unless it is one, in UTF-8, with finite numbers and Unicode
    strings."""
    if not raw.strip():
        raise RequestError(400, 'the request body is empty: send a JSON object, e.g. {"model": "policy", '
                                '"messages": [...]}', None, "invalid_json")
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_finite, parse_float=_finite)
    except RecursionError:
        raise RequestError(400, "the request body nests JSON too deeply to parse: flatten it", None,
                           "invalid_json") from None
    except ValueError as e:  # UnicodeDecodeError is one
        raise RequestError(400, f"the request body is not JSON ({str(e)[:120]}): send a JSON object encoded as "
                                "UTF-8", None, "invalid_json") from None
    need(isinstance(body, dict), "the request body", "a JSON object", body)
    where = lone_surrogate(body) if _SURROGATE.search(raw) else None
    if where is not None:
        raise RequestError(400, f"{where} holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its "
                                "pair): no Unicode text; send valid Unicode", where, "invalid_type")
    return body
