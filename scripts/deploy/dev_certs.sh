#!/usr/bin/env bash
# Makes a CA and the three services' certificates for k8s/components/tls, with the names the
# manifests dial, and prints the kubectl commands that store them as Secrets. For trying TLS out;
# in production let cert-manager issue them (docs/deploy.md).
# Usage: scripts/deploy/dev_certs.sh OUT_DIR [NAMESPACE]   (default namespace: infinigen)
set -euo pipefail
if [ "$#" -lt 1 ]; then
  echo "usage: $0 OUT_DIR [NAMESPACE]" >&2
  exit 2
fi
out="$1"
ns="${2:-infinigen}"
mkdir -p "$out"
cd "$out"
openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 365 \
  -subj "/CN=infinigen-ca" 2>/dev/null

# name -> subjectAltName: the router is dialled by clients through its Service; workers by the
# router through their headless Service's name (it checks that name, not the pod IP); stores by
# their pod names under the stores' headless Service, namespace-qualified (disaggregated; a
# wildcard needs a dotted parent name) or at 127.0.0.1 by the worker beside them (collocated).
declare -A sans=(
  [router]="DNS:infinigen-router,DNS:infinigen-router.$ns,DNS:infinigen-router.$ns.svc,DNS:localhost"
  [worker]="DNS:infinigen-worker,DNS:infinigen-worker.$ns,DNS:infinigen-worker.$ns.svc"
  [kvstore]="DNS:*.infinigen-kvstore.$ns.svc,DNS:*.infinigen-kvstore.$ns.svc.cluster.local,IP:127.0.0.1"
)
for service in router worker kvstore; do
  openssl req -newkey rsa:2048 -nodes -keyout "$service.key" -out "$service.csr" \
    -subj "/CN=infinigen-$service" 2>/dev/null
  printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "${sans[$service]}" \
    >"$service.ext"
  openssl x509 -req -in "$service.csr" -CA ca.crt -CAkey ca.key -CAcreateserial \
    -out "$service.crt" -days 365 -extfile "$service.ext" 2>/dev/null
  rm -f "$service.csr" "$service.ext"
done
rm -f ca.srl
for service in router worker kvstore; do
  echo "kubectl -n $ns create secret generic infinigen-$service-tls --type=kubernetes.io/tls" \
    "--from-file=tls.crt=$out/$service.crt --from-file=tls.key=$out/$service.key" \
    "--from-file=ca.crt=$out/ca.crt"
done
