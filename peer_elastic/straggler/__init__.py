"""Stragglers: a peer that is slow but alive, measured, shown, and acted on.

In synchronous data parallelism the slowest peer sets everyone's pace. Each peer measures,
between two checks, the time it spent on its own work and the time it spent waiting on the
others (:mod:`~peer_elastic.straggler.waits`, :mod:`~peer_elastic.straggler.meter`); about
once a second the group exchanges these running sums in one small all-reduce
(:mod:`~peer_elastic.straggler.exchange`), and every rank derives the same per-peer
slowness scores from the agreed values (:mod:`~peer_elastic.straggler.score`). A peer that
stays above ``straggler_threshold`` for ``straggler_window_s``
(:mod:`~peer_elastic.straggler.detector`) says so in the event log and, under
``straggler_policy=evict``, leaves the job gracefully when the job is faster without it
(:mod:`~peer_elastic.straggler.policy`). :mod:`~peer_elastic.straggler.watch` ties these
to a peer's checks; :mod:`~peer_elastic.straggler.reporting` does the etcd writes.

This package's ``__init__`` imports nothing: :mod:`~peer_elastic.straggler.waits` is
imported by modules that must not import torch.
"""
