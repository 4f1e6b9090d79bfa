#!/usr/bin/env bash
# Install the system packages that building and testing scd need, when they are missing:
# protoc (etcd-client's build), etcd (the scheduler tests run a real one) and iproute2 (`ip` and
# `tc`: the transport's network-namespace test). Uses Debian's packages; needs root or sudo.
# Also the official `openai`, `prometheus_client`, `opentelemetry-proto` and `grpcio` Python
# packages, in their own virtual environment under .cache/ (the tests drive the HTTP API with
# the first, parse the metrics with the second, and receive and decode exported traces, over
# OTLP/HTTP and OTLP/gRPC, with the last two). Safe to run again.
set -euo pipefail
venv="$(cd "$(dirname "$0")/.." && pwd)/.cache/openai-venv"
if ! "$venv/bin/python" -c "import openai, prometheus_client, opentelemetry.proto, grpc" >/dev/null 2>&1; then
  echo "setup: installing openai, prometheus_client, opentelemetry-proto and grpcio into $venv ..."
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check openai prometheus-client opentelemetry-proto grpcio
fi
need=()
command -v protoc >/dev/null 2>&1 || need+=(protobuf-compiler)
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
{ command -v ip && command -v tc; } >/dev/null 2>&1 || need+=(iproute2)
if [ ${#need[@]} -eq 0 ]; then
  echo "setup: protoc, etcd and iproute2 present"
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "setup: installing ${need[*]} ..."
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
# Debian's etcd-server package starts a system etcd on 2379; our tests start their own on free
# ports, so the system one is left alone.
echo "setup: installed ${need[*]}"
