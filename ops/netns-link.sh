#!/usr/bin/env bash
# Kernel-level link emulation for transport experiments: two network namespaces (scd-a, scd-b)
# joined by a veth pair, shaped with tc (tbf for the rate, netem for the delay when the kernel
# has it). Addresses 10.77.0.1 (scd-a) and 10.77.0.2 (scd-b) exist only inside the namespaces,
# so traffic between them never touches the host's interfaces.
#
#   ops/netns-link.sh up RATE DELAY   e.g. up 100mbit 10ms  (RATE in tc units; DELAY one way)
#   ops/netns-link.sh down
#   ops/netns-link.sh status
#   ops/netns-link.sh check           exit 0 when namespaces can be created here
#
# Run a program on either side with: ip netns exec scd-a <cmd> / ip netns exec scd-b <cmd>.
# SCD_NETNS_PREFIX=<p> names the namespaces <p>-a and <p>-b instead (the transport test uses its
# process id, so that runs at the same time keep their own links).
# Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN).
set -euo pipefail

NS_A=${SCD_NETNS_PREFIX:-scd}-a
NS_B=${SCD_NETNS_PREFIX:-scd}-b
DEV_A=scd-veth-a
DEV_B=scd-veth-b
IP_A=10.77.0.1
IP_B=10.77.0.2

die() { echo "netns-link: $*" >&2; exit 1; }

check() {
    command -v ip >/dev/null || die "iproute2 (ip) is not installed (ops/setup.sh installs it)"
    command -v tc >/dev/null || die "tc is not installed (package iproute2; ops/setup.sh installs it)"
    local probe="scd-probe-$$"
    if ! ip netns add "$probe" 2>/dev/null; then
        die "cannot create network namespaces here (need root / CAP_SYS_ADMIN)"
    fi
    ip netns del "$probe"
}

down() {
    ip netns del "$NS_A" 2>/dev/null || true
    ip netns del "$NS_B" 2>/dev/null || true
}

shape() {
    local ns=$1 dev=$2 rate=$3 delay=$4
    # tbf needs a burst of at least one rate-quantum of the kernel timer; 1 ms worth with a
    # 64 KiB floor works from 1 Mbit/s to 10 Gbit/s.
    local burst=64kb
    if [[ "$delay" != "0" && "$delay" != "0ms" ]]; then
        if ip netns exec "$ns" tc qdisc add dev "$dev" root handle 1: netem delay "$delay" limit 100000 2>/dev/null; then
            ip netns exec "$ns" tc qdisc add dev "$dev" parent 1: handle 2: tbf rate "$rate" burst "$burst" latency 200ms
            return
        fi
        echo "netns-link: netem is not available in this kernel: delay $delay NOT emulated, rate only" >&2
    fi
    ip netns exec "$ns" tc qdisc add dev "$dev" root handle 1: tbf rate "$rate" burst "$burst" latency 200ms
}

up() {
    local rate=${1:?usage: up RATE DELAY} delay=${2:?usage: up RATE DELAY}
    check
    down
    ip netns add "$NS_A"
    ip netns add "$NS_B"
    ip link add "$DEV_A" netns "$NS_A" type veth peer name "$DEV_B" netns "$NS_B"
    ip -n "$NS_A" addr add "$IP_A/24" dev "$DEV_A"
    ip -n "$NS_B" addr add "$IP_B/24" dev "$DEV_B"
    for ns in "$NS_A" "$NS_B"; do ip -n "$ns" link set lo up; done
    ip -n "$NS_A" link set "$DEV_A" up
    ip -n "$NS_B" link set "$DEV_B" up
    shape "$NS_A" "$DEV_A" "$rate" "$delay"
    shape "$NS_B" "$DEV_B" "$rate" "$delay"
    echo "netns-link: $NS_A ($IP_A) <-> $NS_B ($IP_B), rate $rate, one-way delay $delay"
}

status() {
    for pair in "$NS_A:$DEV_A" "$NS_B:$DEV_B"; do
        local ns=${pair%%:*} dev=${pair##*:}
        if ip netns list | grep -qw "$ns"; then
            echo "== $ns"
            ip -n "$ns" -brief addr show dev "$dev"
            ip netns exec "$ns" tc qdisc show dev "$dev"
        else
            echo "== $ns: absent"
        fi
    done
}

case "${1:-}" in
    up) shift; up "$@" ;;
    down) down ;;
    status) status ;;
    check) check ;;
    *) die "usage: $0 up RATE DELAY | down | status | check" ;;
esac
