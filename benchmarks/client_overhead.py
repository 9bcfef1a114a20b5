"""What each agent client costs per request against the run's loopback endpoint, next to calling the client directly.

A scripted engine answers every request at once with the same reply (the answer ``408``: no tool call, so each agent
run is one request and no sandbox), so what is timed is the client side and the endpoint: building the client and the
framework's objects as the agent does per run, the request (HTTP, JSON, the endpoint's validation and template delta)
and parsing the reply. The agents are the real ones of the python-tool task: ``direct`` awaits
``AgentClient.chat_turn`` (the baseline: what ``client.chat`` does), ``openai`` is ``python_tool.openai_agent`` (the
stock client, ``client.openai()``), ``agents SDK`` and ``LangChain`` are ``framework_agents.agents_sdk_agent`` and
``langchain_agent``. Rounds alternate between the clients; each runs ``--concurrency`` agent runs at once, as a step's
agents do; the table gives the median milliseconds per request, the ratio to ``direct`` and the difference (the
overhead per request).

``anthropic`` is ``python_tool.anthropic_agent`` (the stock Anthropic client on ``/v1/messages``) and ``harness`` is
``examples/harness_agent.py`` run by ``Harness`` as its own process per agent run (one batch of runs per round: a
Python start with ``import openai`` per run). A new client is one more entry in ``CLIENTS``: an agent,
``async def agent(client, sample)``, that makes one request when the reply is an answer.

    python benchmarks/client_overhead.py [--rounds 7] [--runs 32] [--concurrency 1,16]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import sys
import time
from pathlib import Path

from transformers import AutoTokenizer

from molt_lightning.agents.chat import ChatTemplate
from molt_lightning.agents.client import AgentClient
from molt_lightning.agents.wire.endpoint import Endpoint
from molt_lightning.engines.base import Generation, RolloutEngine
from molt_lightning.agents.harness import Harness
from molt_lightning.models.tiny import python_tool_policy
from molt_lightning.tasks import framework_agents, python_tool
from molt_lightning.trajectory import Trajectory

SAMPLE = {"question": "What is 12*34?", "answer": 408}


async def direct(client: AgentClient, sample: dict) -> float:
    """The baseline: one chat turn straight through the client, no HTTP."""
    message, _ = await client.chat_turn([{"role": "user", "content": sample["question"]}],
                                        max_tokens=python_tool.MAX_TOKENS, tools=python_tool.TOOLS)
    return python_tool.reward(message["content"], sample)


CLIENTS = {  # name: (agent, the package it needs)
    "direct": (direct, None),
    "openai": (python_tool.openai_agent, "openai"),
    "agents SDK": (framework_agents.agents_sdk_agent, "agents"),
    "LangChain": (framework_agents.langchain_agent, "langchain_openai"),
    "anthropic": (python_tool.anthropic_agent, "anthropic"),
    # a harness in its own process: examples/harness_agent.py with the stock OpenAI client, a Python start per run
    "harness": (Harness([sys.executable, str(Path(__file__).parents[1] / "examples" / "harness_agent.py")]), None),
}
ONCE_PER_ROUND = {"harness"}  # a process per run: one batch of runs per round, not --runs


class FixedEngine(RolloutEngine):
    """Answers every request with ``reply`` (token ids) at once."""

    def __init__(self, reply: list[int]):
        super().__init__()
        self.reply = reply

    async def open(self, model_path): ...
    async def close(self): ...
    async def pause(self): ...
    async def resume(self): ...

    async def _generate(self, prompt_ids, sampling):
        return Generation(list(self.reply), [-0.5] * len(self.reply), [0] * len(self.reply), "stop")


async def round_ms(agent, engine, template, endpoint, n: int) -> float:
    """Milliseconds per request for ``n`` concurrent agent runs, each its own trajectory (and API key)."""
    clients = [AgentClient(engine, Trajectory(i, 0), template, 1.0, 256) for i in range(n)]
    for i, c in enumerate(clients):
        c.attach(endpoint, str(i))
    t0 = time.perf_counter()
    rewards = await asyncio.gather(*[agent(c, dict(SAMPLE)) for c in clients])
    rewards = [r.reward if hasattr(r, "reward") else r for r in rewards]  # a harness returns an AgentResult
    ms = (time.perf_counter() - t0) * 1e3 / n
    for c in clients:
        c.detach()
        assert "endpoint_errors" not in c.trajectory.info, c.trajectory.info
    assert rewards == [1.0] * n  # every run got the reply and scored it
    return ms


async def main(args) -> None:
    template = ChatTemplate(AutoTokenizer.from_pretrained(python_tool_policy()))
    engine = FixedEngine(template.encode("408") + [template.eos_id])
    endpoint = Endpoint(["policy"], temperature=1.0)
    await endpoint.start()
    clients = {name: agent for name, (agent, package) in CLIENTS.items()
               if package is None or importlib.util.find_spec(package) is not None}
    print(f"ms per request (median of {args.rounds} rounds of {args.runs} agent runs; overhead = ms - direct ms)\n")
    print("| concurrency | " + " | ".join(clients) + " |")
    print("|---|" + "---|" * len(clients))
    for n in args.concurrency:
        times = {name: [] for name in clients}
        for agent in clients.values():  # warm-up: imports, connections
            await round_ms(agent, engine, template, endpoint, n)
        for _ in range(args.rounds):
            for name, agent in clients.items():
                repeats = 1 if name in ONCE_PER_ROUND else max(1, args.runs // n)
                ms = [await round_ms(agent, engine, template, endpoint, n) for _ in range(repeats)]
                times[name].append(statistics.mean(ms))
        base = statistics.median(times["direct"])
        cells = [f"{base:.2f}"] + [
            f"{m:.2f} (x{m / base:.1f}, +{m - base:.2f})" for m in (statistics.median(times[k]) for k in clients)
        ][1:]
        print(f"| {n} | " + " | ".join(cells) + " |")
    await endpoint.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--runs", type=int, default=32, help="agent runs per client per round")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    asyncio.run(main(parser.parse_args()))
