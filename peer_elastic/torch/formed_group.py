"""The process group of one generation, as this peer sees it (:class:`FormedGroup`): what the
group manager forms and everything that asks about the current group reads."""

from __future__ import annotations

from dataclasses import dataclass

from peer_elastic.etcd.coordinator import Assignment
from peer_elastic.etcd.deaths import ProbeTarget

__all__ = ["FormedGroup"]


@dataclass(frozen=True)
class FormedGroup:
    """The process group of one generation, as this peer sees it."""

    assignment: Assignment
    backend: str
    formed_at: float  # time.monotonic()
    wait_s: float  # waiting for acks
    init_s: float  # init_process_group
    incarnation: int = 0  # the coordinator's registration this group was formed under
    # Where the roster's probe listeners were when it formed: a member dropped since is no
    # longer in the view, and its probe is what says whether its process is gone.
    probes: tuple[ProbeTarget, ...] = ()

    @property
    def generation(self) -> int:
        return self.assignment.generation

    @property
    def roster(self) -> tuple[str, ...]:
        return self.assignment.roster
