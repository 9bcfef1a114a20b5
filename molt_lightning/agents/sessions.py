"""``AgentSessions``: what the agent runs of one training run (or one evaluation) share, and the client of each run.

Shared: the engine, the sampling temperature and top-p, the context length, the policy's chat template (with its
processor, for a vision-language policy; none when the tokenizer has no chat template: token-level agents only) and
the loopback OpenAI/Anthropic endpoint (``wire.endpoint``), which ``start`` opens on the engine's loop (the engine is
launched by then) and ``stop`` closes. ``client(trajectory, ...)`` makes one run's ``AgentClient`` and registers it
with the endpoint under a key of its own while the run lasts.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from ..engines.base import RolloutEngine
from ..policies.vision import load_processor
from ..trajectory import Trajectory
from .chat import ChatTemplate
from .client import AgentClient
from .wire.endpoint import Endpoint


class AgentSessions:
    def __init__(self, engine: RolloutEngine, model_path: str, tokenizer, temperature: float, max_context: int,
                 host: str = "127.0.0.1", token: str | None = None, top_p: float = 1.0):
        self.engine, self.temperature, self.max_context, self.top_p = engine, temperature, max_context, top_p
        self.template, self.endpoint = None, None
        if getattr(tokenizer, "chat_template", None):
            processor = load_processor(model_path)  # a vision-language policy's (expands images), else None
            if processor is not None and not engine.accepts_images:
                raise ValueError(f"{model_path} is a vision-language policy but {type(engine).__name__} cannot take "
                                 "images: use molt_lightning.engines.TorchEngine (vLLM's vision models need "
                                 "torchvision, which PyPI builds for CUDA only)")
            self.template = ChatTemplate(tokenizer, processor)
            self.endpoint = Endpoint(["policy", os.path.basename(model_path.rstrip("/")), model_path], temperature,
                                     host, token)

    @classmethod
    def for_run(cls, engine: RolloutEngine, model_path: str, tokenizer, rollout, config) -> AgentSessions:
        """The sessions of a run with the ``rollout`` record's settings (``config.Rollout``); the context is its
        ``max_context`` or the policy's own (``config``: the policy's Hugging Face config)."""
        context = rollout.max_context or config.get_text_config().max_position_embeddings  # a VLM: its LM's
        return cls(engine, model_path, tokenizer, rollout.temperature, context, rollout.endpoint_host,
                   rollout.endpoint_token, rollout.top_p)

    def start(self) -> None:
        if self.endpoint is not None:
            self.engine.call(self.endpoint.start(), timeout=60)

    def stop(self) -> None:
        if self.endpoint is not None:
            self.engine.call(self.endpoint.stop(), timeout=30)

    @asynccontextmanager
    async def client(self, trajectory: Trajectory, seed: int | None, counter: Callable[[str, int], None] | None,
                     temperature: float | None = None) -> AsyncIterator[AgentClient]:
        """The client of one agent run, reachable through the endpoint (its own key) while the block runs; it samples
        at the run's temperature unless given another (an evaluation's; 0 is greedy)."""
        temperature = self.temperature if temperature is None else temperature
        client = AgentClient(self.engine, trajectory, self.template, temperature, self.max_context, seed=seed,
                             counter=counter, top_p=self.top_p)
        if self.endpoint is not None:
            client.attach(self.endpoint, f"{trajectory.sample_id}-{trajectory.member}")
        try:
            yield client
        finally:
            client.detach()
