"""Tasks from data (``sources``), verifiers as rewards (``verifiers``), and the one-turn agent that joins them
(``agent.Answer``)."""

from .agent import Answer
from .sources import Source, Tasks
from .verifiers import Verdict, VerifierFailed, verify

__all__ = ["Answer", "Source", "Tasks", "Verdict", "VerifierFailed", "verify"]
