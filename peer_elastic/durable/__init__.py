"""Durable snapshots: the committed state on disk, so a job survives losing every peer.

In-memory commits (``peer_elastic.state.states``) survive the loss of some peers; these survive
the loss of all of them. One module per job:

* :mod:`.layout` (no torch): where snapshots live (``<snapshot_dir>/<job>/snap-...``), the
  manifest with every file's checksum, validation, atomic publication and retention.
* :mod:`.writer`: at a due commit, rank 0 copies the committed state into staging buffers
  and a thread writes them with ``torch.distributed.checkpoint`` (no process group).
* :mod:`.sharded`: sharded (FSDP2 / HSDP) state, where no rank holds all of it: every
  rank writes its own shards with DCP on a dedicated gloo group, off the training thread,
  and :func:`~.sharded.load_sharded` reads them back at any world size or mesh.
* :mod:`.resume`: when a group forms in which nobody holds committed state of the run,
  the ranks agree on the newest valid snapshot any of them can read; one loads it and the
  normal state sync hands it to the others.
* :mod:`.service`: what a :class:`~peer_elastic.elastic.Peer` holds: the writer, the resume
  hook, the final snapshot of a graceful stop, and the etcd records
  (:mod:`peer_elastic.etcd.snapshot_records`) and counters the writer thread reports into.

Dependencies point one way: ``elastic -> durable.service -> durable.{writer,resume} ->
durable.layout`` (and ``durable.sharded -> durable.{writer,layout}``); nothing here imports
``elastic``, and ``layout`` imports no torch.
"""
