"""What both wires of the endpoint share: the request error (rendered in each wire's own shape) and the checks of
sampling settings, ``max_tokens`` and tools. Kept apart so that ``endpoint`` (OpenAI) and ``anthropic_messages`` both
import it."""

from __future__ import annotations

from typing import Any


class RequestError(Exception):
    """A request the endpoint refuses, with the OpenAI error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def check_sampling(body: dict, temperature: float) -> None:
    """Refuse a temperature or top_p other than the run's (both wires): the trainer computes logprobs under the run's
    sampling distribution, so another one would make its importance weights wrong."""
    for name, run_value in (("temperature", temperature), ("top_p", 1.0)):
        value = body.get(name)
        if value is not None and (not isinstance(value, (int, float)) or abs(float(value) - run_value) > 1e-6):
            raise RequestError(400, f"{name}={value} differs from the run's {run_value}: the trainer computes "
                                    f"logprobs under the run's sampling distribution; omit {name}", name,
                               "unsupported_value")


def check_max_tokens(value: Any) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise RequestError(400, f"max_tokens must be a positive integer, got {value!r}", "max_tokens")
    return value


def check_tools(tools: Any, choice: Any, client) -> list | None:
    """OpenAI-style function tools, or None (none given, or ``tool_choice`` none); refused unless the policy can
    take them."""
    if choice not in (None, "auto", "none"):
        raise RequestError(400, f"tool_choice={choice!r} is not supported (it needs constrained decoding); use "
                                "'auto' or 'none'", "tool_choice", "unsupported_value")
    if tools is None or choice == "none":
        return None
    if not isinstance(tools, list):
        raise RequestError(400, "tools must be a list of {'type': 'function', 'function': {...}}", "tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str) or not fn["name"]
                or not isinstance(fn.get("parameters", {}), dict)):
            raise RequestError(400, f"tools[{i}] is malformed: expected {{'type': 'function', 'function': "
                                    "{'name': str, 'description': str, 'parameters': JSON schema object}}",
                               f"tools[{i}]", "invalid_tool_schema")
    if tools and not client.template.handles_tools:
        raise RequestError(400, "this policy cannot take tools: its chat template does not render `tools` or its "
                                "tokenizer has no `response_template` to parse tool calls (transformers' "
                                "parse_response); add both to its tokenizer_config.json", "tools",
                           "tools_not_supported")
    return tools or None
