"""Name resolution shared by every registry: a registered name, or a dotted path to the user's own function."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def resolve(name: str, registry: dict[str, Callable], what: str = "name") -> Callable:
    """A registered name, or a dotted path ``pkg.module.function``; a clear error naming the choices otherwise."""
    if name in registry:
        return registry[name]
    module, _, attr = name.rpartition(".")
    if not module:
        raise ValueError(f"unknown {what} {name!r}: use one of {sorted(registry)} or a dotted path pkg.module.fn")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import {what} {name!r} ({e}); registered names are {sorted(registry)}") from e
