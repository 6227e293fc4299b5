"""A value decided from a few facts, kept while the facts are the very same objects.

The per-step protocol asks on every step what this rank wants (the generation to move to,
and the reset vote derived from it). The answer reads facts that change rarely: the group,
the watched view's snapshot (immutable, a new object at every change), the coordinator's
fatal error and its registration. Deciding anew walks the stop causes, which on a step's hot
path, with the caches cold, costs tens of microseconds; comparing four references does not.

Identity, not equality: a decision may read what an equal-looking object holds, and an
object that is the same is certainly unchanged (the facts are immutable or replaced whole).
"""

from __future__ import annotations

from typing import Generic, TypeVar

__all__ = ["IdentityMemo"]

T = TypeVar("T")


class IdentityMemo(Generic[T]):
    """The last value :meth:`put` with its facts; :meth:`get` returns it while every fact
    is the same object as then, else None (decide anew and put it)."""

    def __init__(self) -> None:
        self._facts: tuple[object, ...] = ()
        self._value: T | None = None

    def get(self, facts: tuple[object, ...]) -> T | None:
        last = self._facts
        if self._value is None or len(last) != len(facts):
            return None
        for was, now in zip(last, facts, strict=True):
            if was is not now:
                return None
        return self._value

    def put(self, facts: tuple[object, ...], value: T) -> T:
        self._facts, self._value = facts, value
        return value
