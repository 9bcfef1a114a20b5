"""The OpenAI-compatible endpoint's cost per request, against calling the engine through the client directly.

The same single-turn chat requests (the default task's questions, ``max_tokens`` new tokens, temperature 1) go to the
torch engine three ways in one run, alternating rounds: ``direct`` awaits ``AgentClient.chat_turn`` (what
``client.chat`` does); ``endpoint`` sends them through the loopback endpoint with the stock ``openai.AsyncOpenAI``
client (``client.openai()``: one shared connection pool; HTTP, JSON, the client's parsing); ``new client`` builds an
``AsyncOpenAI`` per request, as an agent that makes its own client per run does. Each round runs ``--concurrency``
requests at once, as a step's agents do; the table gives the median wall time per request of each way, the ratio, and
the difference from ``direct``: the overhead per request.

    python benchmarks/endpoint_overhead.py [--rounds 5] [--concurrency 1,16] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import openai
from transformers import AutoTokenizer

from molt_lightning.agents.chat import ChatTemplate
from molt_lightning.agents.client import AgentClient
from molt_lightning.agents.wire.endpoint import Endpoint
from molt_lightning.engines import TorchEngine
from molt_lightning.models.tiny import arithmetic_policy
from molt_lightning.tasks.arithmetic import make_problem
from molt_lightning.trajectory import Trajectory


async def round_s(way: str, engine, template, endpoint, n: int, max_tokens: int, rng) -> float:
    """Seconds per request for ``n`` concurrent single-turn requests, each its own trajectory."""
    clients = [AgentClient(engine, Trajectory(i, 0), template, 1.0, 256, seed=rng.randrange(2**31)) for i in range(n)]
    questions = [[{"role": "user", "content": make_problem(rng)["question"]}] for _ in range(n)]
    llms = []
    for i, c in enumerate(clients):
        c.attach(endpoint, f"{i}")
        llms.append(endpoint.openai(c.api_key))  # = client.openai(): one shared connection pool

    async def one(i):
        if way == "direct":
            await clients[i].chat_turn(questions[i], max_tokens=max_tokens)
        elif way == "endpoint":
            await llms[i].chat.completions.create(model="policy", messages=questions[i], max_tokens=max_tokens)
        else:  # what an agent that builds its own client per run pays on top
            async with openai.AsyncOpenAI(base_url=clients[i].base_url, api_key=clients[i].api_key) as llm:
                await llm.chat.completions.create(model="policy", messages=questions[i], max_tokens=max_tokens)

    t0 = time.perf_counter()
    await asyncio.gather(*[one(i) for i in range(n)])
    seconds = (time.perf_counter() - t0) / n
    for c in clients:
        c.detach()
    return seconds


async def main(args) -> None:
    path = arithmetic_policy()
    template = ChatTemplate(AutoTokenizer.from_pretrained(path))
    engine = TorchEngine(seed=0)
    await engine.open(path)
    endpoint = Endpoint(["policy"], temperature=1.0)
    await endpoint.start()
    rng = random.Random(0)
    print("| concurrency | direct ms/request | endpoint (client.openai()) | ratio | overhead ms | endpoint, a new "
          "AsyncOpenAI per request | overhead ms |")
    print("|---|---|---|---|---|---|---|")
    for n in args.concurrency:
        await round_s("endpoint", engine, template, endpoint, n, args.max_tokens, rng)  # warm-up: connections, JIT
        times = {"direct": [], "endpoint": [], "new-client": []}
        for _ in range(args.rounds):
            for way in times:
                times[way].append(await round_s(way, engine, template, endpoint, n, args.max_tokens, rng))
        d, e, c = (statistics.median(times[w]) * 1e3 for w in ("direct", "endpoint", "new-client"))
        print(f"| {n} | {d:.2f} | {e:.2f} | {e / d:.2f} | {e - d:.2f} | {c:.2f} | {c - d:.2f} |")
    await endpoint.stop()
    await engine.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=16)
    asyncio.run(main(parser.parse_args()))
