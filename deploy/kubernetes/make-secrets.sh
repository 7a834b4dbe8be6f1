#!/bin/sh
# Writes the pool's Secrets as YAML on stdout, from a key directory laid
# out by `llamapool keygen` (made here if missing; existing pairs are kept):
#
#   deploy/kubernetes/make-secrets.sh /root/llamapool-keys | kubectl apply -f -
#
# One CURVE pair per role, shared by every pod of that role (a Deployment's
# pods are interchangeable; to revoke one role's key, make a new pair and
# roll that role). API keys: KEYDIR/api-keys, one per line (a first one is
# made if the file is missing), and KEYDIR/prometheus, the key Prometheus
# scrapes the frontends with (also appended to api-keys when made).
# Nothing is sent anywhere: kubectl only formats (--dry-run=client).
set -eu
[ $# -eq 1 ] || { echo "usage: $0 KEYDIR" >&2; exit 2; }
K=$1
NS=${LLAMAPOOL_NAMESPACE:-llamapool}
LLAMAPOOL=${LLAMAPOOL:-llamapool}
KUBECTL=${KUBECTL:-kubectl}

"$LLAMAPOOL" keygen "$K" --worker worker --frontend frontend >&2
umask 077
if [ ! -f "$K/api-keys" ]; then
    od -An -N24 -tx1 /dev/urandom | tr -d ' \n' > "$K/api-keys"
    echo >> "$K/api-keys"
fi
if [ ! -f "$K/prometheus" ]; then
    od -An -N24 -tx1 /dev/urandom | tr -d ' \n' > "$K/prometheus"
    cat "$K/prometheus" >> "$K/api-keys"
    echo >> "$K/api-keys"
fi

secret() {
    name=$1; shift
    "$KUBECTL" create secret generic "$name" --namespace "$NS" \
        --dry-run=client -o yaml "$@"
    echo ---
}
# The broker: its secret key, and the two role directories keygen wrote.
secret llamapool-curve-broker --from-file="$K/broker.key_secret"
secret llamapool-curve-authorized-workers --from-file="$K/authorized/workers"
secret llamapool-curve-authorized-frontends --from-file="$K/authorized/frontends"
# Workers and frontends: the broker's public key and their own pair.
secret llamapool-curve-worker --from-file="$K/broker.key" \
    --from-file="$K/worker.key_secret"
secret llamapool-curve-frontend --from-file="$K/broker.key" \
    --from-file="$K/frontend.key_secret"
secret llamapool-api-keys --from-file=api-keys="$K/api-keys" \
    --from-file=prometheus="$K/prometheus"
