"""Adapters that run environments written for other RL libraries unchanged, as ordinary agent programs.

- ``verifiers_env``: a ``verifiers`` (prime-rl's, ``verifiers.v1``) taskset or env: its tasks become the task stream
  (``VerifiersTasks``), its own rollout machinery plays each one against the run's endpoint and its own rewards are
  the reward (``VerifiersAgent``).
- ``openenv_env``: an OpenEnv (``openenv-core``) ``Environment``, in process or behind its server on 127.0.0.1,
  played in a chat loop with the policy; the environment's reward is the reward (``OpenEnvAgent``).

Neither library is imported until an adapter is used, so this package imports without them.
"""

from .openenv_env import OpenEnvAgent, seeds
from .verifiers_env import VerifiersAgent, VerifiersTasks

__all__ = ["OpenEnvAgent", "VerifiersAgent", "VerifiersTasks", "seeds"]
