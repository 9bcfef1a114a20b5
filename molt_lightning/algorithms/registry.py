"""Name resolution shared by every registry: a registered name, or a dotted path to the user's own function."""

from __future__ import annotations

from collections.abc import Callable

from ..config import NotImported, imported


def resolve(name: str, registry: dict[str, Callable], what: str = "name") -> Callable:
    """A registered name, or a dotted path ``pkg.module.function``; a clear error naming the choices otherwise."""
    if name in registry:
        return registry[name]
    if "." not in name:
        raise ValueError(f"unknown {what} {name!r}: use one of {sorted(registry)} or a dotted path pkg.module.fn")
    try:
        return imported(name, what)
    except NotImported as e:
        raise ValueError(f"cannot import {what} {name!r} ({e.reason}); registered names are {sorted(registry)}") \
            from None
