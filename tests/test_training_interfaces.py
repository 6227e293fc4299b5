"""The training side's narrow interfaces: each part types what it uses of the coordinator,
of a state and of the peer by a Protocol, and what is passed to it has every member.

Nothing checks Protocols at run time, so these tests do: the real ``Coordinator`` (not
started: no etcd), the state classes, ``PeerStats`` and ``Peer`` against the Protocols that
stand for them, and the test fake ``FakeCoordinator`` against the widest one, by building
a ``Peer`` on it.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol

import pytest
import torch

from peer_elastic.durable.service import Counters
from peer_elastic.elastic import Peer, PeerCoordinator
from peer_elastic.etcd.coordinator import Coordinator
from peer_elastic.etcd.stop import MembershipFacts
from peer_elastic.observer import ObservedCoordinator, ObservedPeer, PeerStats
from peer_elastic.publisher import ProgressRecorder
from peer_elastic.sharded.state import ShardedState
from peer_elastic.state import ObjectState, State, TorchState
from peer_elastic.state.protocol import DurableState, ElasticState, SyncedState
from peer_elastic.state_keeping import KeepingCoordinator
from peer_elastic.straggler.watch import StragglerCoordinator
from peer_elastic.torch.group import GroupCoordinator
from peer_elastic.torch.reachability import ReachCoordinator
from tests.helpers.fakes import FakeCoordinator

COORDINATOR_PROTOCOLS = [MembershipFacts, ReachCoordinator, GroupCoordinator,
                         KeepingCoordinator, ProgressRecorder, PeerCoordinator,
                         ObservedCoordinator, StragglerCoordinator]


def protocol_members(proto: type) -> dict[str, Any]:
    """Every member ``proto`` declares, its bases' included: name -> the declaration (a
    function, a property, or an annotation)."""
    members: dict[str, Any] = {}
    for cls in reversed(proto.__mro__):
        if cls in (object, Protocol) or not getattr(cls, "_is_protocol", False):
            continue
        members.update(dict.fromkeys(cls.__dict__.get("__annotations__", {}), "attribute"))
        for name, value in cls.__dict__.items():
            if not name.startswith("_") and (callable(value) or isinstance(value, property)):
                members[name] = value
    return members


def missing(obj: object, proto: type) -> list[str]:
    """The members of ``proto`` that ``obj`` lacks, or has with other parameters."""
    problems = []
    for name, declared in protocol_members(proto).items():
        if not hasattr(obj, name):
            problems.append(f"{name}: missing")
        elif inspect.isfunction(declared):
            wanted = [p for p in inspect.signature(declared).parameters if p != "self"]
            params = inspect.signature(getattr(obj, name)).parameters
            takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
            lacking = [p for p in wanted if p not in params and not takes_any]
            if lacking:
                problems.append(f"{name}: no parameter {', '.join(lacking)}")
    return problems


@pytest.fixture
def coordinator() -> Coordinator:
    return Coordinator(client=object(), job="interfaces")  # type: ignore[arg-type]


@pytest.mark.parametrize("proto", COORDINATOR_PROTOCOLS, ids=lambda p: p.__name__)
def test_the_coordinator_has_what_each_part_of_the_training_side_uses(
        coordinator: Coordinator, proto: type) -> None:
    assert missing(coordinator, proto) == []


@pytest.mark.parametrize("proto", COORDINATOR_PROTOCOLS, ids=lambda p: p.__name__)
def test_the_fake_coordinator_has_it_too(proto: type) -> None:
    assert missing(FakeCoordinator(), proto) == []


@pytest.mark.parametrize("state_type", [State, ObjectState, TorchState, ShardedState],
                         ids=lambda t: t.__name__)
@pytest.mark.parametrize("proto", [SyncedState, DurableState, ElasticState],
                         ids=lambda p: p.__name__)
def test_every_state_kind_is_what_the_run_loop_takes(state_type: type, proto: type) -> None:
    # commit_count is set on the instance (State.__init__): see the test below.
    assert [p for p in missing(state_type, proto) if p != "commit_count: missing"] == []


def test_a_state_counts_its_commits_from_the_start() -> None:
    state = ObjectState(epoch=0)
    assert missing(state, ElasticState) == [] and state.commit_count == 0


def test_the_peer_counters_are_what_the_durable_service_counts_into() -> None:
    assert missing(PeerStats(), Counters) == []


def test_a_peer_is_built_on_what_it_declares_it_uses() -> None:
    # FakeCoordinator implements PeerCoordinator with no etcd: a Peer needs nothing more.
    fake = FakeCoordinator()
    peer = Peer(fake, backend="gloo", abandon_hung_collectives=True)
    try:
        assert missing(peer, ObservedPeer) == []
        assert (peer.rank, peer.size, peer.generation, peer.device) == \
            (-1, 0, 0, torch.device("cpu"))
        peer.check_host_updates()  # no group: a check does nothing
    finally:
        peer.close()
    assert fake.rejoin_gate is None
