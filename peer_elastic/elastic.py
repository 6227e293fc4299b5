"""The elastic run loop: Horovod Elastic semantics on top of the coordination core.

:class:`Peer` owns the per-step protocol (in the manner of torchft's ``Manager``); the
process group it reconfigures lives in :mod:`peer_elastic.torch.group`, the membership in
:mod:`peer_elastic.etcd.coordinator`.

One pass of :meth:`Peer.run`::

    form the group of the newest generation listing us  (standbys wait here)
    -> reset callbacks on every rank (they see the new world size and may use collectives)
    -> agree on state: one all-reduce of (needs state?, commit id); roll back a commit
       that not every rank completed; sync from rank 0 when anyone needs state
    -> call the training function
         HostsUpdatedInterrupt -> keep live state, back to the top
         a failed collective   -> restore the last commit, mark the generation broken,
                                  back to the top
         it returns            -> rank 0 writes `done`; every peer returns the result

``check_host_updates()`` (also inside ``commit()``) does no etcd I/O: it reads the watched
generation from memory and runs one tiny all-reduce, so every roster member raises
``HostsUpdatedInterrupt`` at the same call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from peer_elastic import logs
from peer_elastic.errors import (
    HostsUpdatedInterrupt,
    InternalError,
    LeaveRequested,
    PeerElasticError,
)
from peer_elastic.etcd.coordinator import Coordinator
from peer_elastic.liveness import TrainingWatch
from peer_elastic.sampler import syncing_from
from peer_elastic.torch.abort import HangWatchdog
from peer_elastic.torch.group import FormedGroup, GroupManager, is_collective_failure

log = logging.getLogger(__name__)

R = TypeVar("R")


class Peer:
    """A training process's membership in an elastic job. Create it with :func:`peer_elastic.join`."""

    def __init__(
        self,
        coordinator: Coordinator,
        *,
        backend: str = "auto",
        collective_timeout_s: float = 30.0,
        rendezvous_timeout_s: float = 120.0,
        metrics: Any = None,
        abandon_hung_collectives: bool = True,
    ) -> None:
        self.coordinator = coordinator
        self.groups = GroupManager(coordinator, backend, collective_timeout_s, rendezvous_timeout_s)
        # Frees this peer from a collective stuck on a peer whose lease is gone, after giving
        # the training thread join_timeout to leave the group by itself.
        self._watchdog: HangWatchdog | None = None
        if abandon_hung_collectives:
            groups = self.groups
            self._watchdog = HangWatchdog(
                current=lambda: groups.current,
                lost_peer=groups.lost_peer,  # type: ignore[arg-type]
                abort=groups.abandon,  # type: ignore[arg-type]
                wait_change=coordinator.view.wait_change,
                wake=coordinator.view.wake,
                grace_s=lambda: float(coordinator.config.join_timeout_s or 1.0),
            )
        # Training-thread liveness (peer_elastic.liveness): a training thread stuck in its own
        # code for hang_timeout_s makes this peer dump its stacks, fence itself and exit.
        self._liveness = TrainingWatch(coordinator, lambda: self.generation)
        self._group: FormedGroup | None = None
        self._incarnation = coordinator.incarnation
        self._check_buf: torch.Tensor | None = None
        self._synced_once = False
        self._restored = False
        self.resets = 0
        self.last_reset_s = 0.0
        self.reset_log: list[dict[str, Any]] = []
        self._pending_timing: dict[str, Any] | None = None
        self._progress = _Publisher(coordinator)
        # peer_elastic.metrics.PeerMetrics, or None when off: every hook is one `is None` test.
        self.metrics = metrics if metrics is not None and metrics.enabled else None
        if self.metrics is not None:
            self.metrics.bind(self)

    # -- what the user reads ----------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._group.assignment.rank if self._group else -1

    @property
    def size(self) -> int:
        return self._group.assignment.size if self._group else 0

    @property
    def generation(self) -> int:
        return self._group.assignment.generation if self._group else 0

    @property
    def member_id(self) -> str:
        return self.coordinator.member_id

    @property
    def is_leader(self) -> bool:
        return self.coordinator.is_leader

    @property
    def device(self) -> torch.device:
        """Where collective buffers of this peer's backend live."""
        if self.groups.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # -- the protocol -----------------------------------------------------------------------------

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank at once if membership changed.

        No etcd I/O: the newest generation comes from the watched view in memory. One
        all-reduce (MAX) of "the newest generation I know of" makes every rank decide the
        same; a rank whose lease was lost forces a reset so it never continues in the old
        group.
        """
        group = self._group
        if group is None:
            return
        self._liveness.stepped()
        if self._pending_timing is not None:
            self._publish_timing()
        current = group.assignment.generation
        coord = self.coordinator
        snap = coord.snapshot()
        newest = snap.generation
        want = newest.number if newest is not None else current
        if coord.incarnation != self._incarnation or coord.error or snap.done is not None:
            # Lease lost (we must not go on in this group), a fatal error, or the job ended
            # (e.g. reset limit): everyone stops at this call and the reset path reports it.
            want = max(want, current + 1)
        buf = self._check_buf
        if buf is None:
            buf = self._check_buf = torch.zeros(1, dtype=torch.int64, device=self.device)
        buf.fill_(want)
        with self._liveness.collective():  # waiting here is waiting on the others
            dist.all_reduce(buf, op=dist.ReduceOp.MAX)
            newest_seen = int(buf.item())
        if newest_seen > current:
            removals_only = newest is not None and not newest.joined
            raise HostsUpdatedInterrupt(skip_sync=removals_only)

    def run(self, func: Callable[..., R], state: Any, *args: Any, **kwargs: Any) -> R:
        """Run ``func(state, *args, **kwargs)`` elastically until it returns.

        Returns its result on every peer. A peer that was asked to leave (SIGTERM, drain)
        raises ``SystemExit(0)`` once the job re-formed without it. A peer that finds the
        job finished raises :class:`JobFinished` (``join`` turns it into exit code 0, or 4
        when the job failed).
        """
        if self.metrics is None:
            state._bind(self.check_host_updates)
        else:  # the same checker, timed; state.commit() timed too
            self.metrics.instrument(state, self.check_host_updates)
        if self._watchdog is not None:
            self._watchdog.start()
        self._liveness.start()
        after = 0
        try:
            while True:
                try:
                    self._reset(state, after)
                    with self._liveness.training():  # only time in here can be a hang
                        result = func(state, *args, **kwargs)
                except HostsUpdatedInterrupt as exc:
                    log.info("hosts updated%s: resetting", " (removals only)" if exc.skip_sync else "")
                    after = self.generation
                    continue
                except PeerElasticError:
                    raise
                except Exception as exc:
                    if self._group is None or not is_collective_failure(exc):
                        raise
                    self._on_collective_failure(state, exc)
                    after = self.generation
                    continue
                self._finish()
                return result
        except LeaveRequested as exc:
            self._leave(str(exc))
            raise SystemExit(0) from None
        finally:
            state._bind(None)
            if self.metrics is not None:
                self.metrics.uninstrument(state)

    def _on_collective_failure(self, state: Any, exc: Exception) -> None:
        """A peer died mid-collective: roll back to the last commit and tell the leader."""
        err = InternalError(f"collective failed in generation {self.generation}: {exc}")
        log.warning("%s; restoring the last commit", err)
        state.restore()
        self._restored = True
        try:
            self.coordinator.mark_broken(self.generation, str(exc)[:300])
        except PeerElasticError as e:
            log.warning("could not mark generation %d broken: %s", self.generation, e)

    def _reset(self, state: Any, after: int) -> None:
        t0 = time.monotonic()
        first = self._group is None and after == 0
        restored, incarnation = self._restored, self._incarnation  # how we got here, for metrics
        while True:
            try:
                self._group = self.groups.form(after)
                formed_unix = time.time()
                self._incarnation = self.coordinator.incarnation
                # After the new group exists, before state is synced, on EVERY rank (joiners
                # and the first generation included): callbacks may run collectives, such
                # as rebuilding DDP, and all ranks must enter them together.
                state.on_reset()
                self._agree_and_sync(state)
                self._pending_timing = {"formed": formed_unix, "synced": time.time(),
                                        "gen": self.coordinator.latest_generation}
                break
            except PeerElasticError:
                raise
            except Exception as exc:  # a peer died while we were forming or syncing
                if not is_collective_failure(exc):
                    raise
                log.warning("generation %d failed while forming: %s", self.generation, exc)
                # A sync cut short may have overwritten part of the live state: go back to
                # the last commit (intact: a sync only writes it after completing), so this
                # rank never serves a torn state as the next sync source.
                state.restore()
                self._restored = True
                if self._group is not None:
                    self.coordinator.mark_broken(self.generation, str(exc)[:300])
                    after = self.generation
                self._group = None
        took = time.monotonic() - t0
        if not first:
            self.resets += 1
            self.last_reset_s = took
        a = self._group.assignment
        logs.set_context(member=self.coordinator.member_id, rank=a.rank, generation=a.generation)
        self.reset_log.append({"generation": a.generation, "rank": a.rank, "size": a.size,
                               "seconds": took, "reason": a.reason})
        if self.metrics is not None and not first:
            self.metrics.record_reset(a.reason, took, crashed=restored,
                                      lease_lost=self._incarnation != incarnation)
        log.info("generation %d ready: rank %d of %d in %.3f s", a.generation, a.rank, a.size, took)

    def _agree_and_sync(self, state: Any) -> None:
        need = not self._synced_once or self._restored
        t0 = time.perf_counter()
        src = agree_and_sync(state, self.rank, self.size, self.device, need)
        if self.metrics is not None and src is not None:
            self.metrics.observe_sync(time.perf_counter() - t0)
        self._synced_once = True
        self._restored = False

    def _publish_timing(self) -> None:
        """At the first step after a reset: rank 0 logs where the recovery time went."""
        t, self._pending_timing = self._pending_timing, None
        gen = t["gen"] if t else None
        if self.rank != 0 or gen is None or gen.number != self.generation:
            return
        first_step = time.time()
        detected = gen.detected_unix or gen.written_unix
        timings = {
            "detected_to_written": gen.written_unix - detected,
            "written_to_formed": t["formed"] - gen.written_unix,
            "formed_to_synced": t["synced"] - t["formed"],
            "synced_to_first_step": first_step - t["synced"],
            "total": first_step - detected,
        }
        self._progress.offer_event("generation formed", f"world {self.size}: {gen.reason}",
                                   gen.number, timings)

    def _finish(self) -> None:
        if self.rank == 0:
            try:
                self.coordinator.finish(True, "training function returned")
            except PeerElasticError as exc:
                log.warning("could not record that the job finished: %s", exc)

    def _leave(self, why: str, wait_s: float = 10.0) -> None:
        """We are out of the roster: wait (bounded) until the others formed, then go."""
        log.info("%s", why)
        coord = self.coordinator
        snap = coord.snapshot()
        gen = snap.generation
        if gen is not None:
            coord.view.wait_for(
                lambda s: s.generation is None or s.generation.number != gen.number
                or set(s.generation.roster) <= s.ready_for(gen.number), wait_s)
        self.groups.destroy()

    def record_progress(self, **fields: int) -> None:
        """Publish the committed position for ``peer-elastic status`` (rank 0; no waiting)."""
        if self.rank == 0:
            self._progress.offer(generation=self.generation, world_size=self.size, **fields)

    def waiting_on_peers(self) -> AbstractContextManager[None]:
        """Mark a wait on other peers that the hang detector cannot see on the stack.

        Collectives under ``torch.distributed``, DDP and backward are recognised by
        themselves; wrap anything else that blocks until other peers act (an async
        ``Work.wait()`` from your own code, a device sync that waits for an nccl
        collective) so that time is never taken for a hang of this peer.
        """
        return self._liveness.collective()

    def close(self) -> None:
        self._liveness.stop()
        self._progress.stop()
        if self._watchdog is not None:
            self._watchdog.stop()
        self.groups.destroy()


def agree_and_sync(state: Any, rank: int, size: int, device: torch.device, need: bool) -> int | None:
    """Agree on the newest commit, then sync from a rank holding it if anyone needs it.

    Collective over the default group; returns the rank synced from, or None when nobody
    needed state (a removals-only reset: live state is already identical).

    A commit is ``save()`` then the check collective; when a peer dies during that collective
    it can complete on some ranks and fail on others, leaving them one commit apart. The
    newer commit is consistent (every rank's progress is recorded on every rank), so everyone
    adopts it from the lowest rank that has it, and no work is lost. One all-reduce (MAX) of
    [needs state, commit, -commit] decides; a second runs only when ranks disagree.
    """
    mine = int(getattr(state, "commit_count", 0))
    t = torch.tensor([int(need), mine, -mine], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    any_need, high, low = bool(t[0]), int(t[1]), -int(t[2])
    src = 0
    if low != high:
        owner = torch.tensor([-(rank if mine == high else size)], dtype=torch.int64, device=device)
        dist.all_reduce(owner, op=dist.ReduceOp.MAX)  # -(lowest rank holding the newest)
        src, any_need = -int(owner.item()), True
        log.info("commits differ (%d..%d): adopting commit %d from rank %d", low, high, high, src)
    if not any_need:
        return None
    with syncing_from(src):
        state.sync()
    if hasattr(state, "commit_count"):
        state.commit_count = high
    # The synced state is the new restore point: a failure before the next commit must not
    # roll this rank back to what it held before the sync.
    state.save()
    return src


class _Publisher:
    """Writes progress (the newest, at most once a second) and events from a thread, so
    the training thread never waits on etcd."""

    def __init__(self, coordinator: Coordinator, period_s: float = 1.0) -> None:
        self._coord = coordinator
        self._period = period_s
        self._latest: dict[str, int] | None = None
        self._events: list[tuple[str, str, int, dict[str, float]]] = []
        self._cv = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def offer(self, **fields: int) -> None:
        with self._cv:
            self._latest = fields
            self._start()

    def offer_event(self, kind: str, detail: str, generation: int,
                    timings: dict[str, float]) -> None:
        with self._cv:
            self._events.append((kind, detail, generation, timings))
            self._start()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="publisher", daemon=True)
            self._thread.start()
        self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._latest is not None or self._events
                                  or self._stopped)
                if self._stopped:
                    return
                fields, self._latest = self._latest, None
                events, self._events = self._events, []
            for kind, detail, generation, timings in events:
                self._coord.record_event(kind, detail, generation=generation, timings=timings)
            if fields is not None:
                try:
                    self._coord.record_progress(**fields)
                except PeerElasticError as exc:
                    log.debug("progress not recorded: %s", exc)
                time.sleep(self._period)

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
