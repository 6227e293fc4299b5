#!/bin/sh
# Certificates for an etcd cluster that peer-elastic jobs meet in, made with openssl: one CA,
# etcd's server and peer (member-to-member) certificates, a client certificate for the
# peers and one for the operator (the auth script, etcdctl). EC P-256 keys, SHA-256.
#
#   make-certs.sh [--out DIR] [--days N] [--client-cn CN] SAN [SAN...]
#       the CA (reused when DIR already has one), then every other certificate:
#       DIR/ca.crt ca.key          the CA (keep ca.key offline; only ca.crt is distributed)
#       DIR/server.crt server.key  etcd towards clients: serverAuth + clientAuth, the SANs
#       DIR/peer.crt peer.key      etcd towards the other members: serverAuth + clientAuth,
#                                  the SANs
#       DIR/client.crt client.key  the peers: clientAuth, CN = --client-cn
#       DIR/root.crt root.key      the operator: clientAuth, CN = root (etcd's root user)
#
#   make-certs.sh client [--out DIR] [--days N] CN [NAME]
#       one more client certificate from DIR's CA, as DIR/NAME.crt and NAME.key (NAME
#       defaults to CN): for instance one per job.
#
# SANs are DNS names (wildcards such as '*.etcd.ns.svc' allowed) or IP addresses. They must
# include every host name or address that clients and members put in their etcd URLs:
# every member's name, the names in PEER_ELASTIC_ETCD, and 127.0.0.1 for etcdctl on a member.
# Example for deploy/etcd/etcd-{1,2,3}.conf.yml:
#
#   make-certs.sh --out pki --client-cn peer-elastic-resnet50-example \
#       etcd-1.example.internal etcd-2.example.internal etcd-3.example.internal \
#       192.0.2.11 192.0.2.12 192.0.2.13 127.0.0.1 localhost
#
# With etcd auth on, a client whose certificate's CN is an etcd user is that user without a
# password: --client-cn is then the job's user, peer-elastic-<job> (peer-elastic-auth.sh's
# default). --days sets how long the leaf certificates are valid (default 365; the CA: ten
# years). Keys are written with mode 0600. OPENSSL names the openssl binary.
set -eu

OPENSSL=${OPENSSL:-openssl}
CA_DAYS=3650

usage() {
    cat >&2 <<EOF
usage: make-certs.sh [--out DIR] [--days N] [--client-cn CN] SAN [SAN...]
       make-certs.sh client [--out DIR] [--days N] CN [NAME]
(see the comments at the top of this script)
EOF
    exit 2
}

# openssl's chatter goes to the terminal only when it fails.
run() {
    log=$(mktemp)
    if ! "$@" >"$log" 2>&1; then
        cat "$log" >&2
        rm -f "$log"
        die "failed: $*"
    fi
    rm -f "$log"
}

die() {
    echo "make-certs.sh: $*" >&2
    exit 2
}

# A leaf's extensions go through a file: -addext would need one option per SAN, and the
# file lets the SAN list be built in a loop.
write_ext() {  # FILE EKU [SAN...]
    file=$1 eku=$2
    shift 2
    {
        echo "basicConstraints = critical, CA:FALSE"
        echo "keyUsage = critical, digitalSignature"
        echo "extendedKeyUsage = $eku"
        echo "subjectKeyIdentifier = hash"
        echo "authorityKeyIdentifier = keyid, issuer"
        if [ $# -gt 0 ]; then
            sans=""
            for san in "$@"; do
                if is_ip "$san"; then
                    sans="$sans${sans:+, }IP:$san"
                else
                    sans="$sans${sans:+, }DNS:$san"
                fi
            done
            echo "subjectAltName = $sans"
        fi
    } >"$file"
}

is_ip() {
    case $1 in
    *:*) return 0 ;;  # IPv6 (a DNS name has no colon)
    *[!0-9.]*) return 1 ;;
    *.*.*.*) return 0 ;;
    *) return 1 ;;
    esac
}

new_key() {  # FILE
    rm -f "$1"
    (umask 077 && run "$OPENSSL" genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1")
}

make_ca() {
    if [ -f "$OUT/ca.crt" ] && [ -f "$OUT/ca.key" ]; then
        return  # reuse: certificates already handed out stay trusted
    fi
    new_key "$OUT/ca.key"
    run "$OPENSSL" req -x509 -new -key "$OUT/ca.key" -sha256 -days "$CA_DAYS" \
        -subj "/CN=peer-elastic etcd CA" \
        -addext "basicConstraints = critical, CA:TRUE" \
        -addext "keyUsage = critical, keyCertSign, cRLSign" \
        -out "$OUT/ca.crt"
}

leaf() {  # NAME CN EKU [SAN...]
    name=$1 cn=$2 eku=$3
    shift 3
    [ -f "$OUT/ca.crt" ] && [ -f "$OUT/ca.key" ] || die "no CA in $OUT (ca.crt, ca.key)"
    ext=$(mktemp)
    csr=$(mktemp)
    write_ext "$ext" "$eku" "$@"
    new_key "$OUT/$name.key"
    run "$OPENSSL" req -new -key "$OUT/$name.key" -subj "/CN=$cn" -out "$csr"
    run "$OPENSSL" x509 -req -in "$csr" -CA "$OUT/ca.crt" -CAkey "$OUT/ca.key" -CAcreateserial \
        -CAserial "$OUT/ca.srl" -sha256 -days "$DAYS" -extfile "$ext" \
        -out "$OUT/$name.crt"
    rm -f "$ext" "$csr"
}

OUT=pki
DAYS=365
CLIENT_CN=peer-elastic
MODE=all
if [ "${1:-}" = client ]; then
    MODE=client
    shift
fi
while [ $# -gt 0 ]; do
    case $1 in
    -o | --out) [ $# -ge 2 ] || usage; OUT=$2; shift 2 ;;
    --days) [ $# -ge 2 ] || usage; DAYS=$2; shift 2 ;;
    --client-cn) [ "$MODE" = all ] && [ $# -ge 2 ] || usage; CLIENT_CN=$2; shift 2 ;;
    -h | --help) usage ;;
    --) shift; break ;;
    -*) usage ;;
    *) break ;;
    esac
done
case $DAYS in '' | *[!0-9]* | 0) die "--days wants a positive number of days, got '$DAYS'" ;; esac
check_cn() {
    # -subj splits at '/'; a CN is an etcd user name, which has none.
    case $1 in '' | */*) die "bad common name '$1'" ;; esac
}
[ "$MODE" = all ] && check_cn "$CLIENT_CN"
[ "$MODE" = client ] && [ $# -ge 1 ] && check_cn "$1"
command -v "$OPENSSL" >/dev/null 2>&1 || die "openssl not found (set OPENSSL)"
mkdir -p "$OUT"

case $MODE in
all)
    [ $# -ge 1 ] || die "give the SANs of etcd's certificates (host names, IP addresses)"
    make_ca
    leaf server etcd "serverAuth, clientAuth" "$@"
    leaf peer etcd-peer "serverAuth, clientAuth" "$@"
    leaf client "$CLIENT_CN" clientAuth
    leaf root root clientAuth
    ;;
client)
    [ $# -ge 1 ] && [ $# -le 2 ] || usage
    case ${2:-$1} in */* | .* | '') die "bad file name '${2:-$1}'" ;; esac
    leaf "${2:-$1}" "$1" clientAuth
    ;;
esac
echo "make-certs.sh: certificates in $OUT" >&2
