"""IdentityMemo: a value kept while its facts are the very same objects."""

from __future__ import annotations

from peer_elastic.process.memo import IdentityMemo


def test_the_value_stands_only_while_every_fact_is_the_same_object() -> None:
    group, snap, error = object(), object(), None
    memo: IdentityMemo[tuple[int, str]] = IdentityMemo()
    assert memo.get((group, snap, error, 1)) is None  # nothing decided yet
    value = memo.put((group, snap, error, 1), (3, "reset"))
    assert memo.get((group, snap, error, 1)) is value
    # Any fact another object (a new snapshot, an error appearing, a new registration, a
    # new group), or facts of another shape: decide anew.
    for facts in ((group, object(), error, 1), (group, snap, RuntimeError("x"), 1),
                  (group, snap, error, 2), (object(), snap, error, 1), (group, snap, error)):
        assert memo.get(facts) is None
    assert memo.get((group, snap, error, 1)) is value  # a miss does not forget it


def test_equal_is_not_the_same() -> None:
    memo: IdentityMemo[str] = IdentityMemo()
    big = 10**6
    memo.put((big,), "decided")
    assert memo.get((big,)) == "decided"
    assert memo.get((int("1" + "0" * 6),)) is None  # equal, but another object
