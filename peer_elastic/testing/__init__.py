"""Test helpers that ship with the package: real etcd clusters, TLS and extra client
addresses (:mod:`peer_elastic.testing.etcd`). Nothing a peer needs at run time."""

from peer_elastic.testing.etcd import EtcdCluster, EtcdTestServer

__all__ = ["EtcdCluster", "EtcdTestServer"]
