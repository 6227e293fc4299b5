"""The torch layer: one process group per generation, and what travels in it.

* :mod:`.group` (``GroupManager``) forms torch's default group for each generation over an
  etcd store (:mod:`.store`) past a commit point (:mod:`.barrier`); :mod:`.formed_group`,
  :mod:`.reachability` and :mod:`.lost_peer` are what it knows and asks of a group.
* :mod:`.gloo`: a group's connections: the hang watchdog, held and retired groups, the
  formation guard, subgroup timeouts.
* :mod:`.check`: the per-step check's collectives.
* :mod:`.transport`: how state travels: the sync source, buckets, broadcasts, the layout
  check.
"""
