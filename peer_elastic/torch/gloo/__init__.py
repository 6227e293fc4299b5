"""What a process group leaves in this process and how it is cut loose: its connections, its
listeners, the groups kept after their destruction, and the timeouts of the groups a
training script makes.

* :mod:`.abort`: the hang watchdog: a group stuck on a lost peer is abandoned
  (``GroupConnections``: a group's connections, captured while it formed).
* :mod:`.held_connections`: an abandoned group's connections, kept open a while.
* :mod:`.retired_groups`: destroyed groups, kept alive so that no user object frees one.
* :mod:`.stranded_connect`: frees a rank gloo leaves waiting for a member that died while
  the group formed.
* :mod:`.gloo_records`: gloo's rank records in the store, and the listeners they name.
* :mod:`.subgroup_timeout`: groups the script makes without a timeout get the job's.

``peer_elastic.torch.group.GroupManager`` uses them.
"""
