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
