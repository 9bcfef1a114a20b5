"""A rollout engine that returns pre-set replies: lets tests pin the client's and the endpoint's bookkeeping."""

from __future__ import annotations

from molt_lightning.engines.base import Generation, RolloutEngine


class ScriptedEngine(RolloutEngine):
    """Answers the k-th request with the k-th of ``replies`` (token ids; any iterable, e.g. ``itertools.repeat``),
    every token with logprob -0.5 and policy ``version``; keeps every prompt in ``prompts``."""

    def __init__(self, replies, version: int = 0):
        super().__init__()
        self.replies, self.reply_version, self.prompts = iter(replies), version, []

    async def open(self, model_path): ...
    async def close(self): ...
    async def stage(self, bucket): ...
    async def load(self): ...
    async def tag(self, version): ...
    async def pause(self): ...
    async def resume(self): ...

    async def _generate(self, prompt_ids, sampling):
        self.prompts.append(prompt_ids)
        ids = list(next(self.replies))
        return Generation(ids, [-0.5] * len(ids), [self.reply_version] * len(ids), "stop")


class CutEngine(ScriptedEngine):
    """A ``ScriptedEngine`` that keeps to ``max_tokens``: a longer reply is cut there and finished ``"length"``, as
    every engine does."""

    async def _generate(self, prompt_ids, sampling):
        out = await super()._generate(prompt_ids, sampling)
        if len(out.token_ids) <= sampling.max_tokens:
            return out
        n = sampling.max_tokens
        return Generation(out.token_ids[:n], out.logprobs[:n], out.versions[:n], "length")


def run_at_endpoint(template, replies, run, *, counter=None, max_context: int = 256, version: int = 0,
                    catch: bool = False):
    """Await ``run(client)`` with an ``AgentClient`` registered at a live loopback ``Endpoint`` in front of a
    ``ScriptedEngine`` that answers ``replies`` (texts, each ended with the end-of-turn token; any iterable) in turn.
    Returns (what ``run`` returned, or with ``catch`` the exception it raised, the client)."""
    import asyncio

    from molt_lightning.agents.client import AgentClient
    from molt_lightning.agents.wire.endpoint import Endpoint
    from molt_lightning.trajectory import Trajectory

    engine = ScriptedEngine((template.encode(r) + [template.eos_id] for r in replies), version=version)

    async def main():
        endpoint = Endpoint(["policy"], temperature=1.0)
        await endpoint.start()
        client = AgentClient(engine, Trajectory(0, 0), template, 1.0, max_context, counter=counter)
        client.attach(endpoint, "0-0")
        try:
            return await run(client), client
        except Exception as e:
            if not catch:
                raise
            return e, client
        finally:
            await endpoint.stop()

    return asyncio.run(main())
