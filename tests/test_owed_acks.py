"""OwedAcks: a registration acks each generation that lists it once, and once more after it
broke; an ack etcd did not take stays owed (the coordination thread's side runs in
test_coordination.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from peer_elastic.etcd.owed_acks import OwedAcks
from peer_elastic.etcd.writer import AckKind


def _snap(number: int, roster: list[str], broken: bool = False) -> Any:
    return SimpleNamespace(generation=SimpleNamespace(number=number),
                           roster_ids=lambda: frozenset(roster),
                           broken={number: {"x": object()}} if broken else {})


def test_each_ack_is_owed_until_given_and_only_while_listed() -> None:
    acks = OwedAcks()
    assert acks.owed(SimpleNamespace(generation=None), "a") == []
    assert acks.owed(_snap(3, ["b"]), "a") == []  # a standby owes nothing
    assert acks.owed(_snap(3, ["a", "b"]), "a") == [AckKind.READY]
    assert acks.owed(_snap(3, ["a", "b"]), "a") == [AckKind.READY]  # not taken: owed again
    acks.given(AckKind.READY, 3)
    assert acks.owed(_snap(3, ["a", "b"]), "a") == []
    assert acks.owed(_snap(3, ["a", "b"], broken=True), "a") == [AckKind.ALIVE]
    acks.given(AckKind.ALIVE, 3)
    assert acks.owed(_snap(3, ["a", "b"], broken=True), "a") == []
    assert acks.owed(_snap(4, ["a"], broken=True), "a") == [AckKind.READY, AckKind.ALIVE]


def test_a_new_registration_owes_every_ack_again() -> None:
    acks = OwedAcks()
    acks.given(AckKind.READY, 3)
    acks.forget()
    assert acks.owed(_snap(3, ["a"]), "a") == [AckKind.READY]
