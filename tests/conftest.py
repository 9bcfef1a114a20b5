"""Shared fixtures: the embedded tiny policy (built once per machine), and one real vLLM engine per test session."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def policy_path() -> str:
    from molt_lightning.models.tiny import arithmetic_policy

    return arithmetic_policy()


@pytest.fixture(scope="session")
def tokenizer(policy_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(policy_path)


@pytest.fixture(scope="session")
def vllm_engine(policy_path):
    """One in-process vLLM engine for the whole session (start-up costs 25-60 s); modules share it."""
    pytest.importorskip("vllm")
    from molt_lightning.engines import VLLMEngine

    engine = VLLMEngine(seed=0)
    engine.launch(policy_path)
    yield engine
    engine.release()
