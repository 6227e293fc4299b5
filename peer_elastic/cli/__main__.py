"""``python -m peer_elastic.cli``: the ``peer-elastic`` command."""

from peer_elastic.cli import entry

entry()
