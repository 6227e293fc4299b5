#!/bin/sh
# etcd RBAC for peer-elastic: each job gets a role that may read and write only its own
# prefix, /peer-elastic/<job>/, and a user holding that role. See docs/operations.md.
#
#   peer-elastic-auth.sh enable                 create the root user, turn auth on (once)
#   peer-elastic-auth.sh grant JOB [USER]       role + user for one job
#
# etcdctl reads its connection from the environment; use the root client certificate:
#   export ETCDCTL_ENDPOINTS=https://etcd-1.example.internal:2379
#   export ETCDCTL_CACERT=/etc/etcd/pki/ca.crt ETCDCTL_CERT=root.crt ETCDCTL_KEY=root.key
#
# USER defaults to peer-elastic-JOB. With etcd's client-cert-auth a client whose
# certificate's common name (CN) is USER is that user, and needs no password. To use a
# password instead, put it in PEER_ELASTIC_ETCD_PASSWORD when running "grant" (it is
# read from stdin by etcdctl, never passed on a command line).
# ETCDCTL names the etcdctl binary (default: etcdctl on PATH).
set -eu

ETCDCTL=${ETCDCTL:-etcdctl}

usage() {
    echo "usage: $0 enable | grant JOB [USER]" >&2
    exit 2
}

case "${1:-}" in
enable)
    # auth enable needs a root user holding the root role. It has no password: the
    # operator authenticates with a client certificate whose CN is "root".
    "$ETCDCTL" user add root --no-password
    "$ETCDCTL" user grant-role root root
    "$ETCDCTL" auth enable
    ;;
grant)
    [ $# -ge 2 ] || usage
    JOB=$2
    ETCD_USER=${3:-peer-elastic-$JOB}
    ROLE=peer-elastic-$JOB
    "$ETCDCTL" role add "$ROLE"
    # The trailing slash matters: without it job "a" could touch job "ab".
    "$ETCDCTL" role grant-permission "$ROLE" --prefix=true readwrite "/peer-elastic/$JOB/"
    if [ -n "${PEER_ELASTIC_ETCD_PASSWORD:-}" ]; then
        printf '%s\n' "$PEER_ELASTIC_ETCD_PASSWORD" | "$ETCDCTL" user add "$ETCD_USER" --interactive=false
    else
        "$ETCDCTL" user add "$ETCD_USER" --no-password
    fi
    "$ETCDCTL" user grant-role "$ETCD_USER" "$ROLE"
    ;;
*)
    usage
    ;;
esac
