#!/usr/bin/env bash
# Install the system packages that building and testing scd need, when they are missing:
# protoc (etcd-client's build), etcd (the scheduler tests run a real one) and iproute2 (`ip` and
# `tc`: the transport's network-namespace test). Uses Debian's packages; needs root or sudo.
# Safe to run again.
set -euo pipefail
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
