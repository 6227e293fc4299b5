"""Elastic sampler: partitions one epoch over a world that may change in the middle of it.

Semantics follow ``horovod.torch.elastic.ElasticSampler`` so ported code keeps working:

* the epoch's order is a permutation that depends only on ``(seed, epoch)``;
* ``record_batch`` / ``record_indices`` after each processed batch mark samples as done;
* after a reset the samples of the epoch that are not done yet are re-partitioned over the
  new world, so no sample is dropped or (with ``pad=False``) seen twice;
* ``set_epoch(epoch)`` with a new epoch clears the progress and moves on (Horovod calls it at
  the END of an epoch). With the epoch the sampler is already in, it keeps the progress, so
  ``DistributedSampler``'s habit of calling it at the START of every epoch, re-entered after
  a reset, resumes the epoch instead of starting it over.

Processed samples are a bitmap (one ``uint8`` per sample), so merging the progress of all
ranks is one ``all_reduce(MAX)`` of ``len(dataset)`` bytes instead of pickled Python sets
gathered from every rank, and ``state_dict()`` is a packed bit tensor plus a few ints.

When the elastic loop must call what (``TorchState`` does it through its sampler handler):

* once a new process group exists and state is synced: ``reset()`` (``TorchState.on_reset``
  calls it), which re-partitions for the new world; this alone is enough when the sync is
  skipped (e.g. a removals-only change), because ``record_batch`` keeps the progress
  identical on every rank;
* when state is synchronised: ``sync()``, which adopts the sync source's epoch and progress
  (a broadcast, never a merge: progress belongs to the model state it was recorded with,
  and the source's model is the one everybody adopts) and re-partitions;
* after ``restore()`` of a commit: nothing extra, ``load_state_dict`` re-partitions.

Progress recorded on one rank only (``record_indices``, or ``record_all_ranks=False``) must be
merged (``merge``) while the ranks still hold the same model state: the run loop does it in
every commit and before every reset (``has_local_progress`` tells it when). ``reset`` warns
when a re-partition finds unmerged progress.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import numpy as np
import torch

from peer_elastic.torch.transport.collectives import (
    all_reduce_max_inplace,
    broadcast_inplace,
    world_from_dist,
)

__all__ = ["ElasticSampler"]

_log = logging.getLogger(__name__)


def _pad_to_multiple(indices: torch.Tensor, world: int) -> torch.Tensor:
    """Repeat samples from the start (cyclically) until the length divides by ``world``."""
    n = indices.numel()
    if n == 0:
        return indices
    total = math.ceil(n / world) * world
    extra = total - n
    if extra == 0:
        return indices
    repeats = math.ceil(extra / n)
    return torch.cat([indices, indices.repeat(repeats)[:extra]])


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Sampler that shards an epoch over the ranks and re-shards what is left after a reset.

    Args:
        dataset: anything with ``len()``; its length must not change.
        shuffle: visit samples in a permutation that depends on ``(seed, epoch)`` only.
        seed: must be the same on every rank (``sync`` adopts the sync source's).
        pad: ``True`` (Horovod's behaviour) repeats a few samples so every shard has the same
            length, which keeps ranks in lockstep. ``False`` repeats nothing: every unprocessed
            sample is in exactly one shard and shard lengths differ by at most one.
        record_all_ranks: ``True`` (default): ``record_batch`` marks batch ``batch_idx`` of
            *every* rank's shard, because in synchronous data-parallel training all ranks
            finish batch ``batch_idx`` together. The progress is then the same on every rank
            without any communication and survives the crash of the rank that processed a
            sample (like Horovod's current ``processed_num`` counter). ``False``: mark only
            this rank's samples; the run loop merges the ranks' progress in every
            commit and before every reset (one all-reduce of the bitmap).
    """

    def __init__(
        self,
        dataset: Sized,
        shuffle: bool = True,
        seed: int = 0,
        pad: bool = True,
        *,
        record_all_ranks: bool = True,
    ) -> None:
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.pad = bool(pad)
        self.record_all_ranks = bool(record_all_ranks)
        self.epoch = 0
        self.rank = 0
        self.num_replicas = 1
        n = len(dataset)
        # One spare byte at the end carries a "mismatch" flag through the merge all-reduce.
        self._wire = torch.zeros(n + 1, dtype=torch.uint8)
        self._processed = self._wire[:n]
        self._pinned_world: tuple[int, int] | None = None
        # True while this rank holds progress the other ranks do not know (local records).
        self._unmerged = False
        self._kept_progress_said = False  # set_epoch's "progress kept" is logged once
        self._perm_key: tuple[int, int, int, bool] | None = None
        self._perm = torch.empty(0, dtype=torch.int64)
        self._remaining = torch.empty(0, dtype=torch.int64)
        self._schedule = torch.empty(0, dtype=torch.int64)
        self._shard = torch.empty(0, dtype=torch.int64)
        self.reset()

    # --- partitioning -------------------------------------------------------------------

    def set_world(self, rank: int | None, size: int | None) -> None:
        """Pin (rank, world size) instead of reading them from ``torch.distributed``, then
        re-partition. ``set_world(None, None)`` un-pins. Meant for tests and custom loops."""
        if rank is None or size is None:
            self._pinned_world = None
        else:
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"invalid rank {rank} for world size {size}")
            self._pinned_world = (int(rank), int(size))
        self.reset()

    def reset(self) -> None:
        """Re-partition the samples not processed yet over the current world.

        Purely local (no collective). Call it once the new process group exists; every rank
        must hold the same progress first (``record_all_ranks=True`` or a ``sync()``/``merge``).
        """
        self.rank, self.num_replicas = self._pinned_world or world_from_dist()
        if self._unmerged and self.num_replicas > 1:
            warnings.warn(
                "ElasticSampler re-partitioned while holding progress recorded on this rank "
                "only (record_indices or record_all_ranks=False) that was never merged: ranks "
                "may disagree on the remaining samples. sync() or merge() first.",
                RuntimeWarning,
                stacklevel=2,
            )
        perm = self._epoch_permutation().numpy()
        # numpy's gather is ~20x faster than torch's for this (10M samples: 55 ms vs 1 s).
        unprocessed = self._processed.numpy()[perm] == 0
        self._remaining = torch.from_numpy(perm[unprocessed])
        if self.pad:
            self._schedule = _pad_to_multiple(self._remaining, self.num_replicas)
        else:
            self._schedule = self._remaining
        self._shard = self._schedule[self.rank :: self.num_replicas]

    def _epoch_permutation(self) -> torch.Tensor:
        """The epoch's order of all samples; cached because it is the costly part of reset."""
        n = self._processed.numel()
        key = (self.seed, self.epoch, n, self.shuffle)
        if key != self._perm_key:
            if self.shuffle:
                generator = torch.Generator()
                generator.manual_seed(self.seed + self.epoch)
                self._perm = torch.randperm(n, generator=generator)
            else:
                self._perm = torch.arange(n)
            self._perm_key = key
        return self._perm

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: forget progress and re-partition the new permutation.

        Call it at the end of an epoch with the next epoch's number (as in Horovod), or at the
        start of each epoch (as with ``DistributedSampler``). Setting the epoch the sampler is
        already in while some of it is done keeps that progress: after a reset the training
        function runs again from its top, and a start-of-epoch ``set_epoch`` must not throw
        away what the reset kept (every sample would be trained twice).
        """
        epoch = int(epoch)
        if epoch == self.epoch and (self._unmerged or self.processed_count > 0):
            if not self._kept_progress_said:
                self._kept_progress_said = True
                _log.info("ElasticSampler.set_epoch(%d): already in epoch %d with %d samples "
                          "done; their progress is kept", epoch, epoch, self.processed_count)
            return
        self.epoch = epoch
        self._processed.zero_()
        self._unmerged = False
        self.reset()

    # --- progress -----------------------------------------------------------------------

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark batch ``batch_idx`` (positions ``[batch_idx*batch_size, (batch_idx+1)*batch_size)``
        of the shard as of the last reset) as processed; see ``record_all_ranks``."""
        if batch_idx < 0 or batch_size <= 0:
            raise ValueError(f"invalid batch_idx={batch_idx} / batch_size={batch_size}")
        start, stop = batch_idx * batch_size, (batch_idx + 1) * batch_size
        if self.record_all_ranks:
            # Position p of rank r's shard is schedule[p * world + r]: one contiguous slice.
            world = self.num_replicas
            done = self._schedule[start * world : stop * world]
        else:
            done = self._shard[start:stop]
            self._unmerged = True
        self._processed[done] = 1

    def record_indices(self, indices: Iterable[int] | torch.Tensor) -> None:
        """Mark dataset indices as processed on this rank (merged at the next commit or reset by
        the run loop, or by ``merge``)."""
        idx = torch.as_tensor(indices if isinstance(indices, torch.Tensor) else list(indices))
        idx = idx.to(torch.int64).reshape(-1)
        n = self._processed.numel()
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise IndexError(f"sample index out of range for a dataset of {n}")
        self._processed[idx] = 1
        self._unmerged = True

    @property
    def has_local_progress(self) -> bool:
        """True while this rank holds recorded progress that was not merged with the other
        ranks (``record_indices``, or ``record_batch`` with ``record_all_ranks=False``)."""
        return self._unmerged

    @property
    def processed_count(self) -> int:
        """Samples of this epoch marked processed (as known on this rank)."""
        return int(np.count_nonzero(self._processed.numpy()))

    @property
    def processed_mask(self) -> torch.Tensor:
        """Copy of the bitmap: ``mask[i]`` is true when sample ``i`` was processed."""
        return self._processed.to(torch.bool)

    @property
    def remaining_indices(self) -> list[int]:
        """Samples not processed as of the last reset, in epoch order (all ranks together)."""
        return self._remaining.tolist()

    @property
    def num_samples(self) -> int:
        """Length of this rank's shard (Horovod's name for it)."""
        return self._shard.numel()

    # --- cross-rank -----------------------------------------------------------------------

    def merge(self) -> None:
        """Union of every rank's progress, in place: ONE ``all_reduce(MAX)`` of the bitmap.

        Collective: every rank of the default group must call it, with the same dataset
        length and epoch (``sync`` ensures both). Does not re-partition; call ``reset``.
        """
        if world_from_dist()[1] <= 1:
            return
        all_reduce_max_inplace(self._wire)
        self._unmerged = False
        if self._wire[-1]:
            self._wire[-1] = 0
            raise ValueError("ElasticSampler: dataset length differs between ranks")

    def sync(self) -> None:
        """Adopt the sync source's epoch, seed, settings and progress; re-partition.

        Collective: a 40-byte header broadcast, a one-byte all-reduce that makes a dataset
        length mismatch raise ValueError on every rank, and the bitmap broadcast. Progress is
        taken from the source, not merged: it must come with the model state it describes
        (merge local records with ``merge`` before the ranks' states can diverge).
        """
        if world_from_dist()[1] <= 1:
            self.reset()
            return
        n = self._processed.numel()
        header = torch.tensor(
            [self.epoch, self.seed, n, int(self.shuffle), int(self.pad)], dtype=torch.int64
        )
        broadcast_inplace(header)
        epoch, seed, n0, shuffle, pad = (int(v) for v in header.tolist())
        mismatch = torch.tensor([int(n0 != n)], dtype=torch.uint8)
        all_reduce_max_inplace(mismatch)
        if mismatch.item():
            raise ValueError(f"ElasticSampler: dataset length differs between ranks ({n} here, "
                             f"{n0} on the sync source)")
        broadcast_inplace(self._processed)
        self.epoch, self.seed, self.shuffle, self.pad = epoch, seed, bool(shuffle), bool(pad)
        self._unmerged = False
        self.reset()

    # --- checkpointing --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Compact, pickle-free state: ints and one packed bit tensor (``len(dataset)/8`` bytes).

        Safe for ``torch.save`` and ``torch.load(..., weights_only=True)``.
        """
        packed = np.packbits(self._processed.numpy(), bitorder="little")
        return {
            "epoch": self.epoch,
            "seed": self.seed,
            "num_samples_total": self._processed.numel(),
            "processed_bits": torch.from_numpy(packed),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()`` (from any world size) and re-partition."""
        n = self._processed.numel()
        total = int(state_dict["num_samples_total"])
        if total != n:
            raise ValueError(f"state is for a dataset of {total} samples, this one has {n}")
        bits = torch.as_tensor(state_dict["processed_bits"], dtype=torch.uint8).cpu()
        if bits.numel() != (n + 7) // 8:
            raise ValueError(f"processed_bits has {bits.numel()} bytes, expected {(n + 7) // 8}")
        unpacked = np.unpackbits(bits.numpy(), count=n, bitorder="little")
        self._processed.copy_(torch.from_numpy(unpacked))
        self.epoch = int(state_dict["epoch"])
        self.seed = int(state_dict["seed"])
        self._unmerged = False  # a restore is followed by a sync, which merges
        self.reset()

    # --- Sampler protocol -------------------------------------------------------------------

    def __iter__(self) -> Iterator[int]:
        return iter(self._shard.tolist())

    def __len__(self) -> int:
        return self._shard.numel()
