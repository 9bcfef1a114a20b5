"""The python-tool task (``python_tool.openai_agent``) written with two agent frameworks, as their users write them.

``agents_sdk_agent`` is an OpenAI Agents SDK ``Agent`` with a ``@function_tool``; ``langchain_agent`` is LangChain's
``ChatOpenAI(...).bind_tools([python])`` in a plain tool loop (langchain-core has no agent loop of its own; that lives
in the ``langchain``/``langgraph`` packages). Both point a stock client at the run's loopback endpoint
(``client.base_url``, ``client.api_key``), run the code the policy asks for in ``python_tool.sandbox()`` and are
scored by ``python_tool.reward`` on the final reply. They keep python_tool's budget (``MAX_TURNS`` model calls of at
most ``MAX_TOKENS`` tokens: the tiny policy's context is 256 tokens), and an episode whose conversation outgrows the
context (the endpoint's ``context_length_exceeded``) ends unanswered, as in ``openai_agent``.

Both frameworks' requests are ones the endpoint already accepts (the Agents SDK adds ``"strict": true`` and
``additionalProperties: false`` to the tool, LangChain sends ``"stream": false`` and ``max_completion_tokens``; neither
sends a temperature, ``tool_choice`` or ``parallel_tool_calls`` unless told to). What needed settings or handling:
tracing (the Agents SDK traces every run to OpenAI unless ``RunConfig(tracing_disabled=True)``; LangSmith's tracing is
pinned off too, whatever the environment says), retries (LangChain's client retries twice by default;
``max_retries=0``, as ``client.openai()`` has), a call of an unknown tool (the Agents SDK raises; the episode ends
unanswered) and the ``max_turns`` limit (the Agents SDK raises ``MaxTurnsExceeded``: unanswered), tool errors (the
Agents SDK hides them from the model unless given a ``failure_error_function``) and tool-call arguments that are JSON
but not an object (LangChain's ``AIMessage`` refuses them: unanswered; the endpoint itself now returns such a call
as text, so this guard is for other servers).

    molt fit --config recipes/python_tool.yaml --model.agent molt_lightning.tasks.framework_agents.agents_sdk_agent
"""

from __future__ import annotations

from typing import Any

from .python_tool import MAX_TOKENS, MAX_TURNS, reward, run_python

BAD_ARGUMENTS = 'error: bad arguments (expected {"code": "..."})'  # short: the tiny policy's context is 256 tokens


def make_agents_sdk_agent(max_tokens: int = MAX_TOKENS, max_turns: int = MAX_TURNS, score=reward):
    """The task as an OpenAI Agents SDK agent: ``Agent`` + ``@function_tool`` + ``Runner.run``."""

    async def agent(client, sample: dict[str, Any]) -> float:
        from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool
        from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError
        from openai import BadRequestError

        outputs: list[str] = []

        def bad_call(ctx, error: Exception) -> str:  # arguments that are not {"code": str}: tell the model (briefly)
            client.count("tool_error/bad_arguments")
            return BAD_ARGUMENTS

        @function_tool(failure_error_function=bad_call)
        async def python(code: str) -> str:
            """Run Python code in a sandbox; returns what it prints."""
            outputs.append(await run_python(client, code))
            return outputs[-1]

        solver = Agent(name="solver", tools=[python],
                       model=OpenAIChatCompletionsModel(model="policy", openai_client=client.openai()),
                       model_settings=ModelSettings(max_tokens=max_tokens))
        try:
            result = await Runner.run(solver, sample["question"], max_turns=max_turns,
                                      run_config=RunConfig(tracing_disabled=True))  # no traces sent to OpenAI
        except MaxTurnsExceeded:  # the last turn was a tool call too: no answer
            return score(None, sample, outputs)
        except ModelBehaviorError as e:  # e.g. a call of a tool that does not exist: the episode ends unanswered
            client.count("tool_error/unknown_tool" if "not found in agent" in str(e) else "model_behavior_error")
            return score(None, sample, outputs)
        except BadRequestError as e:
            if e.code != "context_length_exceeded":
                raise
            return score(None, sample, outputs)  # the conversation outgrew the context: unanswered
        return score(result.final_output, sample, outputs)

    return agent


def make_langchain_agent(max_tokens: int = MAX_TOKENS, max_turns: int = MAX_TURNS, score=reward):
    """The task as a LangChain agent: ``ChatOpenAI(...).bind_tools([python])`` and a tool loop."""

    async def agent(client, sample: dict[str, Any]) -> float:
        from langchain_core.tools import tool
        from langchain_openai import ChatOpenAI
        from langsmith import tracing_context

        outputs: list[str] = []

        @tool
        async def python(code: str) -> str:
            """Run Python code in a sandbox; returns what it prints."""
            outputs.append(await run_python(client, code))
            return outputs[-1]

        llm = ChatOpenAI(model="policy", base_url=client.base_url, api_key=client.api_key, max_tokens=max_tokens,
                         max_retries=0,  # a refused request is the agent's answer, not a transient error
                         use_responses_api=False)  # the endpoint serves chat completions
        with tracing_context(enabled=False):  # no LangSmith traces, whatever LANGSMITH_TRACING says
            reply = await _tool_loop(client, llm.bind_tools([python]), {python.name: python}, sample["question"],
                                     max_turns)
        return score(reply, sample, outputs)

    return agent


async def _tool_loop(client, llm, tools: dict, question: str, max_turns: int) -> str | None:
    """LangChain's tool-calling loop: ask, run the tool calls, send back their results; the final reply (None when the
    episode ends on a tool call, a refused request or arguments LangChain cannot hold)."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from openai import BadRequestError
    from pydantic import ValidationError

    messages: list[Any] = [HumanMessage(question)]
    for _ in range(max_turns):
        try:
            message = await llm.ainvoke(messages)
        except BadRequestError as e:  # langchain_openai's OpenAIInvalidRequestError/ContextOverflowError are ones too
            if e.code != "context_length_exceeded":
                raise
            return None  # the conversation outgrew the context: the episode ends unanswered
        except ValidationError:  # tool-call arguments that are JSON but not an object: AIMessage cannot hold them
            client.count("tool_error/bad_arguments")
            return None
        messages.append(message)
        if not message.tool_calls:
            return message.content
        for call in message.tool_calls:
            if call["name"] not in tools:
                client.count("tool_error/unknown_tool")
                messages.append(ToolMessage(f"error: no tool named {call['name']!r}", tool_call_id=call["id"]))
                continue
            try:
                messages.append(await tools[call["name"]].ainvoke(call))  # a ToolCall in: a ToolMessage out
            except ValidationError:  # arguments that are not {"code": str}: tell the model (briefly)
                client.count("tool_error/bad_arguments")
                messages.append(ToolMessage(BAD_ARGUMENTS, tool_call_id=call["id"]))
    return None  # the episode must end with an answer, not a tool call


agents_sdk_agent = make_agents_sdk_agent()  # --model.agent molt_lightning.tasks.framework_agents.agents_sdk_agent
langchain_agent = make_langchain_agent()  # --model.agent molt_lightning.tasks.framework_agents.langchain_agent
