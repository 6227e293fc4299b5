"""One peer of a real elastic training job with an exactly-once oracle.

The model's ``counts`` parameter (the epoch being trained) gains exactly 1.0 at ``[i]`` for
every sample ``i`` trained on: each rank's loss is ``-world * counts[batch].sum()``,
gradients are averaged over the world, and SGD with lr 1 adds the count of every sample of
every rank (exact in float64). At each epoch's end, every rank keeps that row's summary (how
many samples it counted other than once, its sum, min and max) in the model's buffers and
starts the next epoch from zero, so a step costs the same however many epochs the job may
run; the row, the summaries and the sampler are one state, committed, restored and synced
together. After the job, every sample of every epoch must have been counted exactly once:
each finished epoch's summary says so, it was finished exactly once, and the epochs never
trained hold nothing. A small network trained with Adam on the side proves optimizer state
stays bit-identical.

Settings come from PEER_ELASTIC_* like any peer; the test knobs are WORKER_* variables:

* ``WORKER_SAMPLES``, ``WORKER_EPOCHS``, ``WORKER_BATCH``, ``WORKER_STEP_S``: the job's size.
* ``WORKER_COMMIT_EVERY=k`` (default 2): ``state.commit()`` after every k-th batch (and at
  each epoch end).
* ``WORKER_CHECK_EVERY=j`` (default 0: never): ``state.check_host_updates()`` after every
  j-th batch that is not a commit, so resets also happen between (rare) commits.
* ``WORKER_RECORD`` how progress is recorded, the README's three ways:
  ``batch`` (default) ``sampler.record_batch(b, BS)``; ``indices``
  ``sampler.record_indices(batch_indices)``; ``local`` ``ElasticSampler(...,
  record_all_ranks=False)`` with ``record_batch``.
* ``WORKER_PLAIN=1``: plain values in the state that must stay consistent with the model: an
  int ``steps`` (batches stepped, empty ones included) and a float ``samples`` (samples
  trained, from the model's own count). At the end ``samples`` must equal the model's total
  count (``plain_ok``; the oracle checks that total), and both are part of the digest.
* ``WORKER_DDP=1``: average gradients with DistributedDataParallel, rebuilt in a reset
  callback (the README's recipe), instead of pe.DistributedOptimizer. With
  ``WORKER_DDP_SUBGROUP=1`` the callback first makes a subgroup of every rank
  (``dist.new_group``) and DDP reduces over it, as over a device mesh's groups; with
  ``WORKER_DDP_SUBGROUP=train`` the training function makes the subgroup and the DDP wrapper
  over it each time it is entered (not a reset callback). With ``WORKER_DDP_HOOK=1`` the
  wrapper averages with ``pe.allreduce_hook`` (the reset vote rides on its gradients).
* ``WORKER_END_FILE=path``: at each epoch start the ranks agree (one MAX all-reduce) whether
  the file exists; if so the job ends there, before ``WORKER_EPOCHS`` (the oracle then checks
  the epochs actually trained). Only at an epoch's start: a job re-entering its training
  function after a reset mid-epoch finishes that epoch first. Lets a test end the job as soon as its schedule is done.
* ``WORKER_HANG_AT=<epoch>:<batch>[:<rank>]``: the training thread blocks forever at the
  start of that batch (on that rank only, if given) while the process (its coordination
  thread, its lease) lives; with ``WORKER_HANG_FLAG=path`` only the first process to get
  there (it creates the file). ``WORKER_HANG_FILE=path``: a peer whose pid is a line of that
  file blocks at its next batch (a test picks a running peer). Prints ``HANGING <pid>
  <epoch> <batch> <generation>`` first.
* ``WORKER_STACKS_AFTER_S=<seconds>``: every thread's stack is written to stderr once no
  batch began for that long (stall_stacks: a Python thread, holding the GIL while it dumps);
  for catching a peer that falls silent in a soak. ``SIGUSR1`` writes them at any time (a
  test that gives up waiting for the peer sends it).
* ``WORKER_SLOW_AT=<epoch>:<batch>:<seconds>[:<rank>]``: that batch takes that much longer
  (a long evaluation, a slow batch); prints ``SLOW <epoch> <batch> <seconds>``.
* ``WORKER_SLOW_DIR=path``: while the file ``path/<pid>`` exists, this peer's own work per
  step takes the seconds written in it longer: a throttled GPU, whose compute is slow and
  whose communication is not (tests/helpers/throttle.py).
* ``WORKER_FIRST_STEP_S=<seconds>``: each time the training function is entered, it spends
  that long before its first batch (compilation, a data loader's warm-up); prints ``WARMUP
  <generation> <seconds>`` first.
* ``WORKER_EXEMPT_AT=<epoch>:<batch>:<seconds>[:<rank>]``: that batch saves a checkpoint of
  its own that takes that much longer, inside ``peer.hang_exempt()``; prints ``EXEMPT <epoch>
  <batch> <seconds>``.
* ``WORKER_STAGING=<plan>``: the first durable snapshots' staging copies (rank 0) go by the
  comma-separated plan, one entry per copy, then normally: ``memory`` raises MemoryError,
  ``oom`` raises torch's out-of-memory error, ``sleep:<seconds>`` takes that much longer.
* ``WORKER_LOADER_WORKERS=n``: each time the training function is entered it starts a
  ``DataLoader`` with ``n`` worker processes (forked then, mid-run, holding a copy of every
  descriptor, as a training loop's workers do) and takes its first item; the workers stay
  until the function is entered again (a new DataLoader replaces it; its idle workers
  exit). With ``WORKER_LOADER_HOLD=path`` every later item waits until that file exists:
  the workers sit in the dataset (a stalled data source), where they do not look whether
  their parent lives; those DataLoaders are all kept until the peer ends. Prints
  ``FORKED <pid>`` once the children of the entry run (with ``WORKER_FORKED_HELPER`` too).
* ``WORKER_EXEC_CHILD=1`` (with ``WORKER_LOADER_HOLD``): after the first commit of each
  entry of the training function it also starts a program that waits for the hold file,
  keeping every descriptor the peer lets a program inherit (``close_fds=False``, as
  ``os.system`` does); ``FORKED`` is printed after that. ``WORKER_EXEC_CHILD=early`` starts
  it as soon as the entry made its children instead, before any check: a program started
  there (between a subgroup's creation and the next check) inherits the subgroup's
  connections, which only a check marks close-on-exec. ``WORKER_EXEC_CHILD=linger`` (no hold
  file needed) starts one there too, replacing the last entry's, that keeps what it inherited
  until 3 s after the peer ends: a killed peer's subgroup connections stay open that long.
* ``WORKER_FORKED_HELPER=1``: each time the training function is entered it stops the
  helper process it started last time (``terminate()``: SIGTERM), prints ``HELPER <pid>
  ended`` or ``HELPER <pid> alive`` (still running 30 s later), and forks a new one (a
  ``multiprocessing`` process with the fork start method, which sleeps until it is stopped
  or its parent ends).

* ``WORKER_STEP_TIMES=1``: every batch also prints ``STEPPED <epoch> <batch> <generation>
  <begin> <end>``, ``time.monotonic()`` (one clock for every process on the machine, network
  namespaces included) before its forward pass and after its optimizer steps, so a test can
  order batches of different peers by when they ran rather than by when it read the lines.

* ``WORKER_SHARDED=fsdp`` or ``hsdp:<degree>`` (optionally ``,redundancy=<k>``): the model
  (the counter and the small network) is a :class:`pe.ShardedState` sharded with FSDP2
  (``fully_shard`` per submodule, summed gradients), rebuilt by peer-elastic for every
  generation; the counter is ``(samples, epochs)`` so its rows split over the ranks, and the
  network's optimizer state is Adam's, sharded too (one optimizer: plain SGD with lr 1 for
  the counter's group, Adam for the network's). The digest is of the gathered state.
  ``WORKER_COMMIT_DIGEST=1``: every commit also prints ``COMMITTED <commits> <digest>`` (a
  collective gather: test-only), so a test can compare the state a reset resharded with the
  commit it came from.

* ``WORKER_DIE_IN_SAVE=<n>:<rank>:<phase>``: (sharded) at its ``n``-th save, the rank that is
  ``rank`` of its group exits at once (``os._exit``, as a SIGKILL): ``transfer`` before its
  copies leave (the others wait for them in vain), ``confirm`` once they arrived, before the
  save's confirming all-reduce. Prints ``DYING <phase>`` first. With ``WORKER_DIE_FLAG=path``
  only the first process to get there dies (it creates the file): saves are counted per
  process, and a peer that joined late reaches its ``n``-th save later, maybe as that rank.
* ``WORKER_SET_EPOCH_AT_START=1``: the loop also calls ``sampler.set_epoch(state.epoch)`` at
  the start of every epoch (``DistributedSampler``'s habit), re-entered after every reset.

Durable snapshots need no knob: set ``PEER_ELASTIC_SNAPSHOT_DIR`` (and ``..._EVERY``) like any
job setting; a whole job restarted resumes from the newest snapshot, and the oracle still
holds (the model's counts and the sampler's progress come from the same snapshot, so the
work after it is redone and counted once). ``WORKER_SLOW_RESUME_S=<seconds>``: verifying a
snapshot before loading it takes that much longer (a large snapshot on a slow disk).

Prints (flushed) ``GEN <generation> <rank> <size>`` after each (re)formation, then
``START <epoch> <samples processed this epoch> <commit count>`` (what the state holds then),
``STEP <epoch> <batch> <generation>`` every few batches, and on rank 0 at the end
``RESULT <json>``.
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

import peer_elastic as pe
from peer_elastic.process.parent_death import die_with_parent
from tests.helpers import at_exit
from tests.helpers.stall_stacks import StallStacks

N = int(os.environ.get("WORKER_SAMPLES", "480"))
EPOCHS = int(os.environ.get("WORKER_EPOCHS", "2"))
BS = int(os.environ.get("WORKER_BATCH", "4"))
STEP_S = float(os.environ.get("WORKER_STEP_S", "0.02"))
SLOW_DIR = os.environ.get("WORKER_SLOW_DIR")
COMMIT_EVERY = int(os.environ.get("WORKER_COMMIT_EVERY", "2"))
CHECK_EVERY = int(os.environ.get("WORKER_CHECK_EVERY", "0"))
RECORD = os.environ.get("WORKER_RECORD", "batch")
PLAIN = os.environ.get("WORKER_PLAIN") == "1"
END_FILE = os.environ.get("WORKER_END_FILE")
STACKS_AFTER_S = float(os.environ.get("WORKER_STACKS_AFTER_S", "0"))
STEP_TIMES = os.environ.get("WORKER_STEP_TIMES") == "1"
RESULT_PATH = os.environ.get("WORKER_RESULT")
SHARDED = os.environ.get("WORKER_SHARDED", "")
COMMIT_DIGEST = os.environ.get("WORKER_COMMIT_DIGEST") == "1"
DIE_IN_SAVE = os.environ.get("WORKER_DIE_IN_SAVE", "")
DIE_FLAG = os.environ.get("WORKER_DIE_FLAG")
EPOCH_AT_START = os.environ.get("WORKER_SET_EPOCH_AT_START") == "1"
# WORKER_DDP=1: average gradients with DistributedDataParallel, rebuilt in a reset callback
# (the README's recipe), instead of pe.DistributedOptimizer.
USE_DDP = os.environ.get("WORKER_DDP") == "1"
DDP_SUBGROUP = os.environ.get("WORKER_DDP_SUBGROUP", "")  # "1": in the callback; or "train"
DDP_HOOK = os.environ.get("WORKER_DDP_HOOK") == "1"
LOADER_WORKERS = int(os.environ.get("WORKER_LOADER_WORKERS", "0"))
LOADER_HOLD = os.environ.get("WORKER_LOADER_HOLD")
FORKED_HELPER = os.environ.get("WORKER_FORKED_HELPER") == "1"
EXEC_CHILD = os.environ.get("WORKER_EXEC_CHILD", "")  # "1": after the first commit; "early"
if EXEC_CHILD not in ("", "1", "early", "linger"):
    raise SystemExit(f"WORKER_EXEC_CHILD={EXEC_CHILD!r}: expected 1, early or linger")
if DDP_SUBGROUP not in ("", "1", "train"):
    raise SystemExit(f"WORKER_DDP_SUBGROUP={DDP_SUBGROUP!r}: expected 1 or train")
if RECORD not in ("batch", "indices", "local"):
    raise SystemExit(f"WORKER_RECORD={RECORD!r}: expected batch, indices or local")

SLOW_RESUME_S = float(os.environ.get("WORKER_SLOW_RESUME_S", "0"))
if SLOW_RESUME_S:
    from peer_elastic.durable.layout import SnapshotDir

    _verify = SnapshotDir.verify

    def _slow_verify(self: SnapshotDir, sid: object) -> object:
        say("SLOW_RESUME", SLOW_RESUME_S)
        time.sleep(SLOW_RESUME_S)
        return _verify(self, sid)  # type: ignore[arg-type]

    SnapshotDir.verify = _slow_verify  # type: ignore[assignment,method-assign]

# --- stalls: WORKER_HANG_AT / WORKER_HANG_FLAG / WORKER_HANG_FILE / WORKER_SLOW_AT ------------
HANG_AT = os.environ.get("WORKER_HANG_AT")
HANG_FLAG = os.environ.get("WORKER_HANG_FLAG")
HANG_FILE = os.environ.get("WORKER_HANG_FILE")
SLOW_AT = os.environ.get("WORKER_SLOW_AT")
FIRST_STEP_S = float(os.environ.get("WORKER_FIRST_STEP_S", "0"))
EXEMPT_AT = os.environ.get("WORKER_EXEMPT_AT")
STAGING_PLAN = [p for p in os.environ.get("WORKER_STAGING", "").split(",") if p]


def _at(spec: str | None, epoch: int, batch: int, rank: int, fields: int) -> list[str] | None:
    """The extra fields of ``spec`` ("epoch:batch:<fields>[:rank]") if it names this batch."""
    if not spec:
        return None
    parts = spec.split(":")
    if int(parts[0]) != epoch or int(parts[1]) != batch:
        return None
    extra = parts[2:2 + fields]
    if len(parts) > 2 + fields and int(parts[2 + fields]) != rank:
        return None
    return extra


def _named_in_hang_file() -> bool:
    try:
        with open(HANG_FILE) as f:  # type: ignore[arg-type]
            return str(os.getpid()) in f.read().split()
    except (FileNotFoundError, TypeError):
        return False


class HeldItems(torch.utils.data.Dataset):
    """Item 0 at once; the others once WORKER_LOADER_HOLD exists (a stalled data source)."""

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> int:
        while i and LOADER_HOLD and not os.path.exists(LOADER_HOLD):
            time.sleep(0.05)  # a data source that stalls, polled as such sources are
        return i


def sleep_until_parent_ends(set_parent_death_signal: Callable[[], None] | None) -> None:
    if set_parent_death_signal is not None:
        set_parent_death_signal()  # a SIGKILLed peer leaves no helper behind
    threading.Event().wait()


def start_waiting_program(programs: list[subprocess.Popen[bytes]]) -> None:
    """WORKER_EXEC_CHILD: a program that waits for the hold file, inheriting every
    descriptor it may (close_fds=False: as os.system runs one)."""
    programs.append(subprocess.Popen(
        ["sh", "-c", 'while [ ! -e "$0" ]; do sleep 0.1; done', str(LOADER_HOLD)],
        close_fds=False))


def start_lingering_program(programs: list[subprocess.Popen[bytes]]) -> None:
    """WORKER_EXEC_CHILD=linger: end the last entry's program and start one that keeps every
    descriptor it may inherit (close_fds=False) until 3 s after this peer ends."""
    while programs:
        old = programs.pop()
        old.kill()
        old.wait(30)
    programs.append(subprocess.Popen(
        ["sh", "-c", 'while kill -0 "$0" 2>/dev/null; do sleep 0.2; done; sleep 3',
         str(os.getpid())], close_fds=False))


def restart_helper(helpers: list[multiprocessing.process.BaseProcess]) -> None:
    """WORKER_FORKED_HELPER: stop the last helper (SIGTERM), say whether it ended, fork one."""
    if helpers:
        old = helpers.pop()
        old.terminate()
        old.join(30)
        say("HELPER", old.pid, "alive" if old.is_alive() else "ended")
    helper = multiprocessing.get_context("fork").Process(
        target=sleep_until_parent_ends, args=(die_with_parent(signal.SIGKILL),), daemon=True)
    helper.start()
    helpers.append(helper)


def hang_forever(epoch: int, batch: int, generation: int) -> None:
    """A training thread stuck for good (a data loader that never yields, say); the
    coordination thread and the lease live on."""
    say("HANGING", os.getpid(), epoch, batch, generation)
    threading.Event().wait()


def step_s() -> float:
    """This step's own work: STEP_S, plus the seconds in WORKER_SLOW_DIR/<pid> if any."""
    if SLOW_DIR:
        try:
            with open(os.path.join(SLOW_DIR, str(os.getpid()))) as f:
                return STEP_S + float(f.read())
        except FileNotFoundError:
            pass
    return STEP_S


def maybe_stall(epoch: int, batch: int, rank: int, generation: int) -> None:
    if _at(HANG_AT, epoch, batch, rank, 0) is not None:
        if HANG_FLAG:
            try:
                os.close(os.open(HANG_FLAG, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return  # another process hung already
        hang_forever(epoch, batch, generation)
    if HANG_FILE and _named_in_hang_file():
        hang_forever(epoch, batch, generation)
    slow = _at(SLOW_AT, epoch, batch, rank, 1)
    if slow is not None:
        say("SLOW", epoch, batch, slow[0])
        time.sleep(float(slow[0]))  # a long step (evaluation, a slow batch)


def maybe_exempt_work(peer: pe.Peer, epoch: int, batch: int, rank: int) -> None:
    """WORKER_EXEMPT_AT: a long checkpoint of the user's own, marked as no hang."""
    long = _at(EXEMPT_AT, epoch, batch, rank, 1)
    if long is not None:
        say("EXEMPT", epoch, batch, long[0])
        with peer.hang_exempt():
            time.sleep(float(long[0]))


def plan_staging() -> None:
    """WORKER_STAGING: the durable snapshots' staging copies go by the plan, then normally."""
    from peer_elastic.durable.writer import Staging

    capture, plan = Staging.capture, list(STAGING_PLAN)

    def planned(self: Staging, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        step = plan.pop(0) if plan else ""
        if step:
            say("STAGING", step)
        if step == "memory":
            raise MemoryError("test: no memory for the staging copy")
        if step == "oom":
            raise torch.OutOfMemoryError("test: CUDA out of memory (the staging copy)")
        if step.startswith("sleep:"):
            time.sleep(float(step.split(":", 1)[1]))
        return capture(self, tensors)

    Staging.capture = planned  # type: ignore[method-assign]
# ----------------------------------------------------------------------------------------------


#: What the oracle keeps of each finished epoch: how often it was finished, how many samples
#: it counted other than once, and its counts' sum, min and max.
FOLDS, WRONG, SUM, LOW, HIGH = range(5)


@dataclass(frozen=True)
class Tally:
    """The oracle's reading of a job's counts: per epoch, the samples counted other than they
    should be (once in a trained epoch, never in the others); the counts' sum; their least
    in a trained epoch and their greatest anywhere."""

    wrong: list[int]
    total: float
    low: float
    high: float

    @staticmethod
    def of_matrix(counts: torch.Tensor, trained: int) -> Tally:
        """From every epoch's counts (epochs x samples)."""
        want = torch.zeros_like(counts)
        want[:trained] = 1.0
        return Tally([int(w) for w in (counts != want).sum(dim=1).tolist()],
                     float(counts.sum()),
                     float(counts[:trained].min()) if trained else 0.0, float(counts.max()))


class Counter(nn.Module):
    """The oracle's counter: ``counts``, the epoch being trained (the one parameter gradients
    reach), and in buffers the summary of each finished epoch (``finished``, columns FOLDS to
    HIGH), the epoch ``counts`` counts (``row_epoch``), and how many epoch ends found the row
    counting another epoch (``misfiled``)."""

    def __init__(self, epochs: int = EPOCHS, samples: int = N) -> None:
        super().__init__()
        self.counts = nn.Parameter(torch.zeros(samples, dtype=torch.float64))
        self.register_buffer("finished", torch.zeros(epochs, 5, dtype=torch.float64))
        self.register_buffer("row_epoch", torch.zeros((), dtype=torch.int64))
        self.register_buffer("misfiled", torch.zeros((), dtype=torch.int64))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.counts[idx]

    @torch.no_grad()
    def finish_epoch(self, epoch: int) -> None:
        """``epoch`` ends: keep its summary, count the next from zero."""
        row = self.counts.detach()
        if int(self.row_epoch) != epoch:
            self.misfiled += 1
        summary = self.finished[epoch]
        summary[FOLDS] += 1
        summary[WRONG:] = torch.stack([(row != 1.0).sum().to(row.dtype), row.sum(), row.min(),
                                       row.max()])
        self.counts.zero_()
        self.row_epoch.fill_(epoch + 1)

    def counted(self) -> float:
        """Every count so far (finished epochs and the current one)."""
        return float(self.finished[:, SUM].sum()) + float(self.counts.detach().sum())

    def tally(self, trained: int) -> Tally:
        """The oracle's reading once ``trained`` epochs are: each finished exactly once and
        exact, the row counting the next one and empty, nothing kept of any later one."""
        done, row = self.finished, self.counts.detach()
        epochs, samples = len(done), len(row)
        folds = done[:, FOLDS].tolist()
        wrong = [int(done[e, WRONG]) if folds[e] == 1 else samples for e in range(trained)]
        wrong += [0 if folds[e] == 0 else samples for e in range(trained, epochs)]
        if trained < epochs:
            wrong[trained] += int((row != 0).sum())
        if int(self.misfiled) or int(self.row_epoch) != trained:
            wrong[min(trained, epochs - 1)] += samples
        high = max(float(row.max()), float(done[:trained, HIGH].max()) if trained else 0.0)
        return Tally(wrong, self.counted(),
                     float(done[:trained, LOW].min()) if trained else 0.0, high)


class Both(nn.Module):
    """The two models behind one forward, so DDP sees every parameter used."""

    def __init__(self, counter: Counter, net: nn.Module) -> None:
        super().__init__()
        self.counter, self.net = counter, net

    def forward(self, idx: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.counter(idx), self.net(x)


class ShardedCounter(nn.Module):
    """The counter with samples on dim 0, so FSDP splits its rows over the ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = nn.Parameter(torch.zeros(N, EPOCHS, dtype=torch.float64))

    def forward(self, idx: torch.Tensor, epoch: int) -> torch.Tensor:
        return self.counts[idx, epoch]


class ShardedBoth(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.counter = ShardedCounter()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, idx: torch.Tensor, x: torch.Tensor, epoch: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.counter(idx, epoch), self.net(x)


class CountingAdam(torch.optim.Adam):
    """Adam, except for parameter groups marked ``counting``: plain SGD with lr 1 (exact
    counts in float64). Their gradients are used and cleared first, so Adam skips them."""

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        with torch.no_grad():
            for group in self.param_groups:
                if group.get("counting"):
                    for p in group["params"]:
                        if p.grad is not None:
                            p.add_(p.grad, alpha=-1.0)
                            p.grad = None
        return super().step(closure)


def sharded_parts() -> dict[str, object]:
    """ShardedState's builders for WORKER_SHARDED."""
    from torch.distributed.fsdp import fully_shard

    mesh, _, extra = SHARDED.partition(",")
    kind, _, degree_s = mesh.partition(":")
    redundancy = int(extra.split("=", 1)[1]) if extra.startswith("redundancy=") else 1
    if kind not in ("fsdp", "hsdp"):
        raise SystemExit(f"WORKER_SHARDED={SHARDED!r}: expected fsdp or hsdp:<degree>")

    def parallelize(model: nn.Module, mesh: object) -> nn.Module:
        fully_shard(model.counter, mesh=mesh)
        fully_shard(model.net, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return pe.sum_gradients(model)

    def optimizer(model: nn.Module) -> torch.optim.Optimizer:
        return CountingAdam([{"params": model.counter.parameters(), "counting": True},
                             {"params": model.net.parameters()}], lr=1e-2)

    return {"model": ShardedBoth, "parallelize": parallelize, "optimizer": optimizer,
            "shard_degree": int(degree_s) if kind == "hsdp" else None,
            "redundancy": redundancy}


def first_to_die() -> bool:
    """True unless WORKER_DIE_FLAG names a file another process created already."""
    if not DIE_FLAG:
        return True
    try:
        os.close(os.open(DIE_FLAG, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def die_in_save() -> None:
    """WORKER_DIE_IN_SAVE: wrap the sharded state's transfer so that one rank dies in it."""
    import peer_elastic.sharded.state as sharded_state

    nth, rank, phase = DIE_IN_SAVE.split(":")
    real = sharded_state.transfer
    calls = [0]

    def transfer(outgoing, incoming):  # type: ignore[no-untyped-def]
        calls[0] += 1
        dying = calls[0] == int(nth) and dist.get_rank() == int(rank) and first_to_die()
        if dying and phase == "transfer":
            say("DYING", phase)
            os._exit(9)
        real(outgoing, incoming)
        if dying:
            say("DYING", phase)
            os._exit(9)

    sharded_state.transfer = transfer  # type: ignore[assignment]


def sharded_digest(state: pe.ShardedState) -> str:
    """Digest of the gathered state (collective: every rank calls it at the same point)."""
    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()
    tensors = [t for _, t in sorted(state.model.state_dict().items())]
    for _, p in state.model.named_parameters():
        tensors += [v for _, v in sorted(state.optimizer.state.get(p, {}).items())]
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.full_tensor()
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    h.update(repr((state.epoch, getattr(state, "steps", None),
                   getattr(state, "samples", None))).encode())
    return h.hexdigest()


def digest(state: pe.TorchState) -> str:
    if SHARDED:
        return sharded_digest(state)  # type: ignore[arg-type]
    h = hashlib.sha256()
    for t in [*state.model.state_dict().values(), *state.net.state_dict().values()]:
        h.update(t.detach().contiguous().numpy().tobytes())
    for opt in (state.optimizer, state.adam):
        for s in opt.state.values():
            for v in s.values():
                if torch.is_tensor(v):
                    h.update(v.detach().contiguous().numpy().tobytes())
    h.update(repr((state.epoch, getattr(state, "steps", None),
                   getattr(state, "samples", None))).encode())
    return h.hexdigest()


def say(*parts: object) -> None:
    # One write per line: the harness sets PYTHONUNBUFFERED and reads stdout and stderr from one
    # pipe, and print(*parts) writes each part separately, so a log line from another thread
    # could land inside a result line ("STEP 0 3 peer-elastic[...]", seen in CI).
    sys.stdout.write(" ".join(map(str, parts)) + "\n")
    sys.stdout.flush()


def end_requested() -> bool:
    """WORKER_END_FILE exists on any rank (one MAX all-reduce: every rank decides the same)."""
    if not END_FILE:
        return False
    flag = torch.tensor([int(os.path.exists(END_FILE))])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def main() -> int:
    at_exit.install()  # stacks on SIGUSR1; the threads join() left, at exit
    stall_stacks = StallStacks(STACKS_AFTER_S) if STACKS_AFTER_S else None
    try:
        return _main(stall_stacks)
    finally:
        if stall_stacks is not None:
            stall_stacks.close()


def _main(stall_stacks: StallStacks | None) -> int:
    torch.manual_seed(os.getpid())  # different initial weights: sync must fix that
    if STAGING_PLAN:
        plan_staging()
    with pe.join() as peer:
        sampler = pe.ElasticSampler(range(N), shuffle=True, seed=1, pad=False,
                                    record_all_ranks=RECORD != "local")
        plain = {"steps": 0, "samples": 0.0} if PLAIN else {}
        if SHARDED:
            state = pe.ShardedState(**sharded_parts(), sampler=sampler, epoch=0, **plain)
            if DIE_IN_SAVE:
                die_in_save()
        else:
            counter = Counter()
            net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
            sgd = torch.optim.SGD(counter.parameters(), lr=1.0)
            adam = torch.optim.Adam(net.parameters(), lr=1e-2)
            if not USE_DDP:
                sgd, adam = pe.DistributedOptimizer(sgd), pe.DistributedOptimizer(adam)
            state = pe.TorchState(model=counter, optimizer=sgd, net=net, adam=adam,
                                  sampler=sampler, epoch=0, **plain)
        seen_sizes: list[int] = []
        holder: dict[str, nn.Module] = {}
        loaders: list[object] = []  # WORKER_LOADER_WORKERS: iterators, their workers alive
        helpers: list[multiprocessing.process.BaseProcess] = []  # WORKER_FORKED_HELPER
        programs: list[subprocess.Popen[bytes]] = []  # WORKER_EXEC_CHILD

        def rebuild_ddp() -> None:
            # Each generation has a new process group: DDP must be rebuilt on it.
            group = dist.new_group(list(range(dist.get_world_size()))) if DDP_SUBGROUP else None
            # No buffer broadcast at each forward: the model's only buffers are the oracle's
            # summaries, equal on every rank by construction (the state keeps them in step).
            ddp = nn.parallel.DistributedDataParallel(Both(counter, net), process_group=group,
                                                      broadcast_buffers=False)
            if DDP_HOOK:
                ddp.register_comm_hook(group, pe.allreduce_hook)
            holder["ddp"] = ddp

        # Every rank enters the callbacks holding the same state (they run after the sync):
        # tests compare these digests within a generation.
        callbacks = [lambda: seen_sizes.append(dist.get_world_size()),
                     lambda: say("CALLBACK", peer.generation, digest(state))]
        if USE_DDP and DDP_SUBGROUP != "train":
            callbacks.append(rebuild_ddp)
        state.register_reset_callbacks(callbacks)

        def train(state: pe.TorchState) -> dict:
            if SHARDED:
                return train_sharded(state)  # type: ignore[arg-type]
            world = dist.get_world_size()
            say("GEN", peer.generation, peer.rank, world)
            say("START", state.epoch, state.sampler.processed_count, state.commit_count)
            if FIRST_STEP_S:
                say("WARMUP", peer.generation, FIRST_STEP_S)
                time.sleep(FIRST_STEP_S)  # compiling, warming a data loader up
            if USE_DDP and DDP_SUBGROUP == "train":
                rebuild_ddp()  # here, not in a reset callback: its connections open mid-run
            if FORKED_HELPER:
                restart_helper(helpers)
            if LOADER_WORKERS:
                if not LOADER_HOLD:  # a stalled worker would hold up the DataLoader's end
                    loaders.clear()
                loaders.append(iter(torch.utils.data.DataLoader(
                    HeldItems(), num_workers=LOADER_WORKERS)))
                next(loaders[-1])
            # The program starts after the entry's first commit, as a training loop's
            # upload would run (the subgroup made above exists then).
            program_due = EXEC_CHILD == "1" and bool(LOADER_HOLD)
            if EXEC_CHILD == "early" and LOADER_HOLD:
                start_waiting_program(programs)
            if EXEC_CHILD == "linger":
                start_lingering_program(programs)
            if (LOADER_WORKERS or FORKED_HELPER or EXEC_CHILD in ("early", "linger")) \
                    and not program_due:
                say("FORKED", os.getpid())  # its children of this entry run now
            # The end is agreed only at an epoch's start: re-entered after a reset in the
            # middle of an epoch, the job finishes that epoch first (the oracle checks whole
            # epochs; ending mid-epoch would leave a part-trained epoch it calls wrong).
            while state.epoch < EPOCHS and not (state.sampler.processed_count == 0
                                                and end_requested()):
                if EPOCH_AT_START:  # DistributedSampler's habit; keeps a reset's progress
                    state.sampler.set_epoch(state.epoch)
                shard = list(iter(state.sampler))
                nb = torch.tensor([math.ceil(len(shard) / BS)])
                dist.all_reduce(nb, op=dist.ReduceOp.MAX)  # lockstep: short ranks step empty
                for b in range(int(nb)):
                    if stall_stacks is not None:
                        stall_stacks.beat()
                    maybe_stall(state.epoch, b, peer.rank, peer.generation)
                    maybe_exempt_work(peer, state.epoch, b, peer.rank)
                    idx = torch.tensor(shard[b * BS:(b + 1) * BS], dtype=torch.int64)
                    began = time.monotonic()
                    state.optimizer.zero_grad()
                    state.adam.zero_grad()
                    x = torch.sin(idx.to(torch.float32)[:, None] * torch.arange(1, 9))
                    # a step adds to the current row only: its sum is the step's count
                    before = float(counter.counts.detach().sum()) if PLAIN else 0.0
                    if USE_DDP:
                        counts, y = holder["ddp"](idx, x)
                    else:
                        counts, y = state.model(idx), state.net(x)
                    loss = -(world * counts).sum()
                    loss2 = ((y - 0.5) ** 2).sum() * (len(idx) > 0)
                    (loss + loss2).backward()
                    state.optimizer.step()
                    state.adam.step()
                    if PLAIN:
                        state.steps += 1
                        state.samples += float(counter.counts.detach().sum()) - before
                    if RECORD == "indices":
                        state.sampler.record_indices(idx)
                    else:
                        state.sampler.record_batch(b, BS)
                    if STEP_TIMES:
                        say("STEPPED", state.epoch, b, peer.generation, f"{began:.6f}",
                            f"{time.monotonic():.6f}")
                    time.sleep(step_s())
                    if b % 5 == 0:
                        say("STEP", state.epoch, b, peer.generation)
                    if (b + 1) % COMMIT_EVERY == 0:
                        state.commit()
                        peer.record_progress(epoch=state.epoch, batch=b, step=state.commit_count)
                        if program_due:
                            program_due = False
                            start_waiting_program(programs)
                            say("FORKED", os.getpid())
                    elif CHECK_EVERY and (b + 1) % CHECK_EVERY == 0:
                        state.check_host_updates()
                counter.finish_epoch(state.epoch)
                state.epoch += 1
                state.sampler.set_epoch(state.epoch)
                state.commit()
            return oracle_result(state, counter.tally(state.epoch))

        def train_sharded(state: pe.ShardedState) -> dict:
            world = dist.get_world_size()
            model, opt = state.model, state.optimizer
            say("GEN", peer.generation, peer.rank, world)
            say("START", state.epoch, state.sampler.processed_count, state.commit_count)
            while state.epoch < EPOCHS and not (state.sampler.processed_count == 0
                                                and end_requested()):
                if EPOCH_AT_START:
                    state.sampler.set_epoch(state.epoch)
                shard = list(iter(state.sampler))
                nb = torch.tensor([math.ceil(len(shard) / BS)])
                dist.all_reduce(nb, op=dist.ReduceOp.MAX)  # lockstep: short ranks step empty
                for b in range(int(nb)):
                    if stall_stacks is not None:
                        stall_stacks.beat()
                    maybe_stall(state.epoch, b, peer.rank, peer.generation)
                    idx = torch.tensor(shard[b * BS:(b + 1) * BS], dtype=torch.int64)
                    opt.zero_grad()
                    x = torch.sin(idx.to(torch.float32)[:, None] * torch.arange(1, 9))
                    counts, y = model(idx, x, state.epoch)
                    loss = -counts.sum()  # summed gradients: every sample adds exactly 1
                    loss2 = ((y - 0.5) ** 2).sum() * (len(idx) > 0)
                    (loss + loss2).backward()
                    opt.step()
                    if PLAIN:
                        state.steps += 1
                        trained = torch.tensor([float(len(idx))], dtype=torch.float64)
                        dist.all_reduce(trained)  # every rank's batch: a global count
                        state.samples += float(trained.item())
                    if RECORD == "indices":
                        state.sampler.record_indices(idx)
                    else:
                        state.sampler.record_batch(b, BS)
                    time.sleep(step_s())
                    if b % 5 == 0:
                        say("STEP", state.epoch, b, peer.generation)
                    if (b + 1) % COMMIT_EVERY == 0:
                        state.commit()
                        peer.record_progress(epoch=state.epoch, batch=b, step=state.commit_count)
                        if COMMIT_DIGEST:
                            say("COMMITTED", state.commit_count, digest(state))
                    elif CHECK_EVERY and (b + 1) % CHECK_EVERY == 0:
                        state.check_host_updates()
                state.epoch += 1
                state.sampler.set_epoch(state.epoch)
                state.commit()
                if COMMIT_DIGEST:
                    say("COMMITTED", state.commit_count, digest(state))
            # the counter sharded as (samples, epochs): gathered, then as (epochs, samples)
            result = oracle_result(state, Tally.of_matrix(
                model.counter.counts.full_tensor().detach().t(), state.epoch))
            result["layout"] = [state.layout.replicas, state.layout.shards]
            return result

        def oracle_result(state: pe.TorchState, tally: Tally) -> dict:
            """The exactly-once oracle's ``tally``, the ranks' digests compared, and this
            rank's counters (collective: every rank calls it at the end)."""
            digests = [None] * dist.get_world_size()
            dist.all_gather_object(digests, digest(state))  # test-only: trusted peers
            trained = state.epoch
            result = {
                "exact": not any(tally.wrong),
                "min": tally.low,
                "max": tally.high,
                # oracle numbers: samples (of all epochs) counted != once, per epoch too
                "wrong": sum(tally.wrong), "sum": tally.total, "want_sum": trained * N,
                "wrong_by_epoch": {e: w for e, w in enumerate(tally.wrong) if w},
                "epochs": trained,
                "identical": len(set(digests)) == 1, "world": dist.get_world_size(),
                "generation": peer.generation, "rank": peer.rank, "resets": peer.resets,
                "reset_sizes": seen_sizes,  # one per formed group, the first included
                # this rank's plain checks: with an exchange, and spaced between two
                "check_exchanges": peer.stats.check_exchanges,
                "checks_spaced": peer.stats.checks_spaced,
                "states_lost": peer.stats.states_lost,
                "snapshots_written": peer.stats.snapshots_written,
                "snapshots_failed": peer.stats.snapshots_failed,
            }
            if PLAIN:
                result["steps"] = state.steps
                result["samples"] = state.samples
                # the plain value must belong to the same commit as the model
                result["plain_ok"] = state.samples == tally.total
            return result

        result = peer.run(train, state)
        if peer.rank == 0:
            say("RESULT", json.dumps(result))
            if RESULT_PATH:
                with open(RESULT_PATH, "w") as f:
                    json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
