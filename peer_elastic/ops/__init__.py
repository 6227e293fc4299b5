"""Operators' view of a job: the launcher's output multiplexer, the timeline built from a
run's events, the dashboard and the report.

Dependencies go one way: ``multiplex`` knows nothing of etcd; ``ranks`` and ``timeline``
read etcd through :mod:`peer_elastic.etcd`; ``dashboard`` and ``report`` render what
``timeline`` builds.
"""
