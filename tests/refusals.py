"""The messages of calls a strategy refuses, for the tests that check each refusal names its fix."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from dtlab.errors import StrategyError


def refusal_messages(attempts: Iterable[Callable[[], object]]) -> list[str]:
    """Each attempt called in order; the message of every ``StrategyError`` raised. An attempt that is
    accepted leaves no message (the caller checks how many there are); any other error propagates."""
    messages = []
    for attempt in attempts:
        try:
            attempt()
        except StrategyError as exc:
            messages.append(str(exc))
    return messages
