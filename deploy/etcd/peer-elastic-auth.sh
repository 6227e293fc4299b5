#!/bin/sh
# etcd RBAC for peer-elastic: each job gets a role that may read and write only its own
# prefix, /peer-elastic/<job>/, and a user holding that role. See docs/deploy.md and
# docs/operations.md.
#
#   peer-elastic-auth.sh enable                         create the root user, turn auth on
#   peer-elastic-auth.sh grant [--torchrun] JOB [USER]  role + user for one job
#
# --torchrun also grants the prefix of the torchrun rendezvous backend,
# /peer-elastic-torchrun/JOB/, for `torchrun --rdzv-backend=peer-elastic --rdzv-id=JOB`.
#
# Both commands can be run again (a Kubernetes Job retried, a second operator): what exists
# already is kept as it is, an existing user's password included.
#
# etcdctl reads its connection from the environment; use the root client certificate
# (deploy/etcd/make-certs.sh writes one, root.crt):
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
    echo "usage: $0 enable | grant [--torchrun] JOB [USER]" >&2
    exit 2
}

# "user get" / "role get" answer for an existing name; anything else (not found, etcd down)
# is "absent", and the add that follows reports what is wrong.
exists() {  # user|role NAME
    "$ETCDCTL" "$1" get "$2" >/dev/null 2>&1
}

case "${1:-}" in
enable)
    # auth enable needs a root user holding the root role. It has no password: the
    # operator authenticates with a client certificate whose CN is "root".
    if ! exists user root; then
        "$ETCDCTL" user add root --no-password
    fi
    "$ETCDCTL" user grant-role root root
    "$ETCDCTL" auth enable
    ;;
grant)
    shift
    TORCHRUN=no
    if [ "${1:-}" = --torchrun ]; then
        TORCHRUN=yes
        shift
    fi
    [ $# -ge 1 ] && [ $# -le 2 ] || usage
    JOB=$1
    # peer-elastic's job names; the torchrun backend quotes its rdzv-id for the key, which
    # leaves these characters as they are, so the prefix below is the one it uses.
    case $JOB in
    '' | *[!A-Za-z0-9_.-]*)
        echo "$0: job name '$JOB': use letters, digits, '_', '.' and '-'" >&2
        exit 2
        ;;
    esac
    [ ${#JOB} -le 128 ] || { echo "$0: job name longer than 128 characters" >&2; exit 2; }
    ETCD_USER=${2:-peer-elastic-$JOB}
    ROLE=peer-elastic-$JOB
    if ! exists role "$ROLE"; then
        "$ETCDCTL" role add "$ROLE"
    fi
    # The trailing slash matters: without it job "a" could touch job "ab".
    "$ETCDCTL" role grant-permission "$ROLE" --prefix=true readwrite "/peer-elastic/$JOB/"
    if [ "$TORCHRUN" = yes ]; then
        # Where the torchrun backend keeps a rendezvous (peer_elastic/torchrun.py, ROOT).
        "$ETCDCTL" role grant-permission "$ROLE" --prefix=true readwrite "/peer-elastic-torchrun/$JOB/"
    fi
    if exists user "$ETCD_USER"; then
        :
    elif [ -n "${PEER_ELASTIC_ETCD_PASSWORD:-}" ]; then
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
