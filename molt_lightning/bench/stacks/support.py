"""What every stack shares: refusing a protocol field it cannot run, naming the field and what it supports."""

from __future__ import annotations


def unsupported(stack: str, field_: str, value, supported) -> ValueError:
    return ValueError(f"stack {stack} cannot run {field_}={value!r} (it supports {supported}); change the protocol "
                      f"or --set {field_}=...")


def check_supported(stack: str, protocol, supported: dict) -> None:
    """Refuse the first protocol field (dotted path) whose value is not among the ones ``supported`` lists."""
    for dotted, ok in supported.items():
        value = protocol.get(dotted)
        if value not in ok:
            raise unsupported(stack, dotted, value, list(ok))
