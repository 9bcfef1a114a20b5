"""The agent side: what an agent program talks to and returns (``client``), the run's sessions (``sessions``), chat
templates (``chat``), gym-style environments (``env``), the one-turn agent for tasks from data (``answer``), agents
that are their own programs (``harness``), the loopback OpenAI/Anthropic endpoint (``wire/``), adapters for other
libraries' environments (``adapters/``) and sandboxed tools (``tools/``)."""

from .answer import Answer
from .client import AgentClient, AgentResult
from .env import EnvAgent, Environment, Step
from .harness import Harness

__all__ = ["AgentClient", "AgentResult", "Answer", "EnvAgent", "Environment", "Harness", "Step"]
