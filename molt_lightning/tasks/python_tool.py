"""Arithmetic with a sandboxed Python tool, by an agent written against the stock OpenAI client.

The agent (``openai_agent``) is what an agent looks like in the wild: ``openai.AsyncOpenAI`` pointed at the run's
loopback endpoint (``client.base_url``, with the trajectory's own ``client.api_key``), ``tools=[python]``, tool calls
executed in ``molt_lightning.agents.tools.sandbox.PythonSandbox`` (no network, a private directory,
time/CPU/memory/process limits), their output sent back as ``tool`` messages. Reward 1 when the final reply is the exact
result.

The tiny policy for it (``molt_lightning.models.tiny.python_tool_policy``) is warm-started on ``demonstration``
dialogues: its chat template renders tool calls Hermes-style (``<tool_call>{"name": ..., "arguments": ...}
</tool_call>``) and its tokenizer's ``response_template`` parses them back, so the endpoint needs nothing
task-specific. Like the default policy it calls the tool in a small share of its answers at the start.

``anthropic_agent`` is the same agent written against the stock Anthropic client (the endpoint's ``/v1/messages``).
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

from .arithmetic import make_problem, tasks  # noqa: F401  (the same task stream as the default task)

MAX_TURNS = 3
MAX_TOKENS = 48
TOOLS = [{"type": "function", "function": {
    "name": "python", "description": "Run Python code in a sandbox; returns what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}]

# The tiny policy's template: ChatML, the tool names in a system line, Hermes-style tool calls.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools: {% for t in tools %}{{ t.function.name }}{{ ', ' if not loop.last }}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# transformers' declarative parser for it (tokenizer_config.json's ``response_template``; see parse_response).
RESPONSE_TEMPLATE = {
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "content": {},
        "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "content": "json", "repeats": True,
                       "transform": {"type": "function", "function": "{content}"}},
    },
}
SPECIAL_TOKENS = ["<tool_call>", "</tool_call>"]
_sandbox = None


def sandbox():
    """The process-wide sandbox the agents share (made on first use)."""
    global _sandbox
    if _sandbox is None:
        from ..agents.tools.sandbox import PythonSandbox

        _sandbox = PythonSandbox(wall_s=5.0, cpu_s=5, memory_mb=256, max_output=300)
    return _sandbox


def tool_text(result) -> str:
    """What the policy sees of a sandbox run: its output, or the error."""
    return result.output.strip() if result.ok else result.as_message().strip()


async def run_python(client, code: str) -> str:
    """Run ``code`` in the shared sandbox; what the policy sees of it. A failed run is counted in the step metrics
    (``agent/tool_error/timeout``, ``.../memory``, ``.../exit`` ...)."""
    result = await sandbox().run(code)
    if not result.ok:
        client.count(f"tool_error/{re.match(r'[a-z]*', result.error).group(0) or 'other'}")
    return tool_text(result)


def reward(reply: str | None, sample: dict[str, Any], outputs: list[str] = ()) -> float:
    """1.0 when the final reply is exactly the result (an integer, nothing else)."""
    m = re.fullmatch(r"\s*(-?\d+)\s*\.?\s*", reply or "")
    return float(m is not None and int(m.group(1)) == sample["answer"])


def graded_reward(reply: str | None, sample: dict[str, Any], outputs: list[str] = ()) -> float:
    """For a chatty real model: 1.0 the final reply is exactly the result; 0.75 the result is its only number; 0.5 it
    is its last number, or a tool run printed exactly the result (the tool was used right); else 0."""
    if reward(reply, sample):
        return 1.0
    numbers = [int(n) for n in re.findall(r"-?\d+", (reply or "").replace(",", ""))]
    if numbers == [sample["answer"]]:
        return 0.75
    right_run = str(sample["answer"]) in [o.strip() for o in outputs]
    return 0.5 if right_run or (numbers and numbers[-1] == sample["answer"]) else 0.0


def make_openai_agent(max_tokens: int, score=reward, suffix: str = "", max_turns: int = MAX_TURNS):
    """An ordinary OpenAI-client agent: chat with tools, run the code it asks for, score the final answer."""

    async def agent(client, sample: dict[str, Any]) -> float:
        import openai

        llm = client.openai()  # = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key), built cheaply
        messages: list[dict[str, Any]] = [{"role": "user", "content": sample["question"] + suffix}]
        reply, outputs = None, []
        for _ in range(max_turns):
            try:
                response = await llm.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                             max_tokens=max_tokens)
            except openai.BadRequestError as e:
                if e.code != "context_length_exceeded":
                    raise
                break  # the conversation outgrew the context: the episode ends unanswered
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            reply = message.content
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                try:
                    code = json.loads(call.function.arguments)["code"]
                except (ValueError, KeyError, TypeError) as e:
                    client.count("tool_error/bad_arguments")
                    text = f"error: bad arguments ({e})"
                else:
                    text = await run_python(client, code)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
                outputs.append(text)
            reply = None  # the episode must end with an answer, not a tool call
        return score(reply, sample, outputs)

    return agent


openai_agent = make_openai_agent(MAX_TOKENS)  # the tiny policy's agent (recipes/python_tool.yaml)

ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


def make_anthropic_agent(max_tokens: int, score=reward, max_turns: int = MAX_TURNS):
    """The same agent written against the stock Anthropic client (``/v1/messages``: tool_use / tool_result blocks)."""

    async def agent(client, sample: dict[str, Any]) -> float:
        import anthropic

        llm = client.anthropic()  # = anthropic.AsyncAnthropic(base_url=client.anthropic_base_url, api_key=...)
        messages: list[dict[str, Any]] = [{"role": "user", "content": sample["question"]}]
        reply, outputs = None, []
        for _ in range(max_turns):
            try:
                response = await llm.messages.create(model="policy", messages=messages, tools=ANTHROPIC_TOOLS,
                                                     max_tokens=max_tokens)
            except anthropic.BadRequestError as e:
                if "prompt is too long" not in str(e):
                    raise
                break  # the conversation outgrew the context: the episode ends unanswered
            messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                              for b in response.content]})
            reply = "".join(b.text for b in response.content if b.type == "text")
            calls = [b for b in response.content if b.type == "tool_use"]
            if response.stop_reason != "tool_use":
                break
            results = []
            for call in calls:
                code = call.input.get("code") if isinstance(call.input, dict) else None
                if not isinstance(code, str):
                    client.count("tool_error/bad_arguments")
                    text = f"error: bad arguments {call.input!r}"
                else:
                    text = await run_python(client, code)
                results.append({"type": "tool_result", "tool_use_id": call.id, "content": text})
                outputs.append(text)
            messages.append({"role": "user", "content": results})
            reply = None  # the episode must end with an answer, not a tool call
        return score(reply, sample, outputs)

    return agent


anthropic_agent = make_anthropic_agent(MAX_TOKENS)  # recipes/python_tool.yaml with --model.agent ...anthropic_agent
# recipes/smollm2_python_tool.yaml: one tool call, then the answer
smollm2_agent = make_openai_agent(64, graded_reward, " Write one line of Python that prints it.", max_turns=2)

# SmolLM2-135M-Instruct writes ```python blocks, not JSON tool calls: its tool-calling template makes such a block a
# call of the python tool, and renders the tool's output as a user turn (models.smollm2.smollm2_python_tool_policy).
SMOLLM2_TEMPLATE = (
    "{% if tools and messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant. To run "
    "Python, write a ```python code block```; what it prints comes back to you.<|im_end|>\n"
    "{% elif messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\nOutput:\n{{ m['content'] }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% for c in m.tool_calls or [] %}```python\n{{ c.function.arguments.code }}```{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SMOLLM2_RESPONSE_TEMPLATE = {
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "content": {},
        "tool_calls": {"open_pattern": "```(?:[Pp]ython3?|py)\n", "close": "```", "content": "text", "repeats": True,
                       "transform": {"type": "function",
                                     "function": {"name": "python", "arguments": {"code": "{content}"}}}},
    },
}


def demonstration(rng: random.Random, p_tool: float) -> list[dict[str, Any]]:
    """A warm-start dialogue: with probability ``p_tool`` the tool route, else a direct (guessed) answer."""
    problem = make_problem(rng)
    user = {"role": "user", "content": problem["question"]}
    if rng.random() < p_tool:
        call = {"type": "function", "function": {"name": "python",
                                                 "arguments": {"code": f"print({problem['expression']})"}}}
        return [user, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": str(problem["answer"])},
                {"role": "assistant", "content": str(problem["answer"])}]
    return [user, {"role": "assistant", "content": str(rng.randint(-99, 99999))}]
