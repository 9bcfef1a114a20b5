"""A harness as its own program: the python-tool agent, written against a stock client, run by
``molt_lightning.agents.harness.Harness`` once per agent run (``recipes/harness.yaml``).

It knows nothing of molt-lightning's API: the stock clients read their endpoint and key from the environment the
Harness sets (``OPENAI_BASE_URL``/``OPENAI_API_KEY`` or ``ANTHROPIC_BASE_URL``/``ANTHROPIC_API_KEY``), the task comes
from ``MOLT_SAMPLE`` (or the command line), and the result goes to standard output: with ``--report reward`` a last
line ``{"reward": r}``, with ``--report answer`` the final answer alone (the Harness's ``score`` verifier grades it).
The python tool runs in molt-lightning's sandbox here only for brevity; any tool runner would do.

    python examples/harness_agent.py --wire anthropic --report answer "What is 12*34?"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os

from molt_lightning.tasks.python_tool import ANTHROPIC_TOOLS, MAX_TOKENS, MAX_TURNS, TOOLS, reward, sandbox, tool_text


async def python(code) -> str:
    if not isinstance(code, str):
        return f"error: bad arguments {code!r}"
    return tool_text(await sandbox().run(code))


async def openai_turns(question: str) -> str | None:
    import openai

    llm, messages = openai.AsyncOpenAI(max_retries=0), [{"role": "user", "content": question}]
    async with llm:
        for _ in range(MAX_TURNS):
            response = await llm.chat.completions.create(model=os.environ.get("MOLT_MODEL", "policy"),
                                                         messages=messages, tools=TOOLS, max_tokens=MAX_TOKENS)
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return message.content
            for call in message.tool_calls:
                try:
                    code = json.loads(call.function.arguments).get("code")
                except (ValueError, AttributeError):
                    code = None
                messages.append({"role": "tool", "tool_call_id": call.id, "content": await python(code)})
    return None


async def anthropic_turns(question: str) -> str | None:
    import anthropic

    llm, messages = anthropic.AsyncAnthropic(max_retries=0), [{"role": "user", "content": question}]
    async with llm:
        for _ in range(MAX_TURNS):
            response = await llm.messages.create(model=os.environ.get("MOLT_MODEL", "policy"), messages=messages,
                                                 tools=ANTHROPIC_TOOLS, max_tokens=MAX_TOKENS)
            messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                              for b in response.content]})
            if response.stop_reason != "tool_use":
                return "".join(b.text for b in response.content if b.type == "text")
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": b.id,
                 "content": await python(b.input.get("code") if isinstance(b.input, dict) else None)}
                for b in response.content if b.type == "tool_use"]})
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", help="the task (default: MOLT_SAMPLE's question)")
    parser.add_argument("--wire", choices=["openai", "anthropic"], default="openai")
    parser.add_argument("--report", choices=["reward", "answer"], default="reward")
    args = parser.parse_args()
    sample = json.loads(os.environ.get("MOLT_SAMPLE", "{}"))
    question = args.question or sample["question"]
    try:
        answer = asyncio.run((openai_turns if args.wire == "openai" else anthropic_turns)(question))
    except Exception as e:  # a conversation past the context ends unanswered, as in the in-process agent
        if "context" not in str(e) and "too long" not in str(e):
            raise
        answer = None
    if args.report == "answer":
        print(answer or "")
    else:
        print(json.dumps({"reward": reward(answer, sample), "info": {"answered": answer is not None}}))


if __name__ == "__main__":
    main()
