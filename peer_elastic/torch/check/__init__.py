"""The per-step check's collectives: how every rank of a group learns at the same call that a
new generation is pending, at the least cost per step.

* :mod:`.pending_check`: the generation exchange, issued at one check, completed at the next.
* :mod:`.check_cadence`: which plain checks exchange when checks come fast.
* :mod:`.max_exchange`: a few ints all-reduced (MAX) cheaply: a check's, a commit's.
* :mod:`.reset_vote`: the same bit carried by a gradient all-reduce (optimizer, DDP hook).

``peer_elastic.elastic.Peer`` drives them; ``peer_elastic.optim`` and
``peer_elastic.ddp_hook`` cast the vote.
"""
