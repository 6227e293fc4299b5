"""What one peer process needs of its operating system, apart from training and etcd.

* :mod:`.threads`: every thread peer-elastic starts, tracked so that none outlives ``join()``.
* :mod:`.signal_relay`: a signal acted on by a thread (its handler takes no lock).
* :mod:`.parent_death`: a child that gets a signal when its launcher dies (Linux).
* :mod:`.owned_dirs`: temp dirs naming their owner processes; the sweep of dead owners' dirs.
* :mod:`.netaddr`: which address and interface this peer's groups use and advertise.
* :mod:`.probe_listener`: the listener whose refused connection proves this peer's death.
* :mod:`.sockets`: this process's sockets by inode, their TCP ends, close-on-exec.
* :mod:`.parent_only_sockets`: ``/dev/null`` over this peer's sockets in forked children.
* :mod:`.memo`: a value kept while the facts it was computed from are the same objects.

Nothing here imports torch.
"""
