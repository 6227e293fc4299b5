"""How state travels between the ranks of a group.

* :mod:`.sync_source`: the rank state broadcasts come from (the newest holder during a sync).
* :mod:`.buckets`: how a list of tensors is cut into the flat buckets that travel.
* :mod:`.collectives`: broadcasts from the sync source: tensors, bytes, plain values.
* :mod:`.layout_check`: every rank has the same structure before bytes are sent into it.
* :mod:`.direct_all_reduce`: the hot path's all-reduce, issued without torch's wrapper.
* :mod:`.snapshots`: kept tensor copies that commits save into and restores copy back from.
"""
