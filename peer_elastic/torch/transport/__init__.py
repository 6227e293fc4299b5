"""How state travels between the ranks of a group.

* :mod:`.collectives`: broadcasts from the sync source, the layout check, buckets.
* :mod:`.direct_all_reduce`: the hot path's all-reduce, issued without torch's wrapper.
* :mod:`.snapshots`: kept tensor copies that commits save into and restores copy back from.
"""
