"""The OpenAI-compatible endpoint's cost per request, against calling the engine through the client directly.

The same single-turn chat requests (the default task's questions, ``max_tokens`` new tokens, temperature 1) go to the
torch engine two ways in one run, alternating rounds: ``direct`` awaits ``AgentClient.chat_turn`` (what ``client.chat``
does), ``endpoint`` sends them with the stock ``openai.AsyncOpenAI`` client through the loopback endpoint (HTTP, JSON,
the client's parsing). Each round runs ``--concurrency`` requests at once, as a step's agents do; the table gives the
median wall time per request of each way, their ratio, and the difference: the endpoint's overhead per request.

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

from molt_lightning.chat import ChatTemplate
from molt_lightning.client import AgentClient
from molt_lightning.endpoint import Endpoint
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
        endpoint.register(c, f"{i}")
        llms.append(openai.AsyncOpenAI(base_url=c.base_url, api_key=c.api_key, max_retries=0))

    async def one(i):
        if way == "direct":
            await clients[i].chat_turn(questions[i], max_tokens=max_tokens)
        else:
            await llms[i].chat.completions.create(model="policy", messages=questions[i], max_tokens=max_tokens)

    t0 = time.perf_counter()
    await asyncio.gather(*[one(i) for i in range(n)])
    seconds = (time.perf_counter() - t0) / n
    for c, llm in zip(clients, llms):
        endpoint.unregister(c)
        await llm.close()
    return seconds


async def main(args) -> None:
    path = arithmetic_policy()
    template = ChatTemplate(AutoTokenizer.from_pretrained(path))
    engine = TorchEngine(seed=0)
    await engine.start(path)
    endpoint = Endpoint(["policy"], temperature=1.0)
    await endpoint.start()
    rng = random.Random(0)
    print("| concurrency | direct ms/request | endpoint ms/request | ratio | overhead ms/request |")
    print("|---|---|---|---|---|")
    for n in args.concurrency:
        await round_s("endpoint", engine, template, endpoint, n, args.max_tokens, rng)  # warm-up: connections, JIT
        times = {"direct": [], "endpoint": []}
        for _ in range(args.rounds):
            for way in times:
                times[way].append(await round_s(way, engine, template, endpoint, n, args.max_tokens, rng))
        d, e = (statistics.median(times[w]) * 1e3 for w in ("direct", "endpoint"))
        print(f"| {n} | {d:.2f} | {e:.2f} | {e / d:.2f} | {e - d:.2f} |")
    await endpoint.stop()
    await engine.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=16)
    asyncio.run(main(parser.parse_args()))
