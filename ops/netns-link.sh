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
#   ops/netns-link.sh control         also join each namespace to the host by its own unshaped
#                                     link (host 10.78.1.1 <-> 10.78.1.2 in -a, host 10.78.2.1
#                                     <-> 10.78.2.2 in -b): a service on the host (etcd) is
#                                     reached from each side apart from the link between them
#   ops/netns-link.sh cut LINK        drop every packet on LINK, both ways, silently (a
#                                     partition, not a refused connection): LINK is data (the
#                                     shaped a<->b link), ctl-a or ctl-b (the control links)
#   ops/netns-link.sh heal LINK       undo cut (the data link gets its shaping back)
#
# Run a program on either side with: ip netns exec scd-a <cmd> / ip netns exec scd-b <cmd>.
# SCD_NETNS_PREFIX=<p> names the namespaces <p>-a and <p>-b instead (the transport test uses its
# process id, so that runs at the same time keep their own links).
# Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN). Control addresses are fixed, so one prefix at
# a time may have control links.
set -euo pipefail

NS_A=${SCD_NETNS_PREFIX:-scd}-a
NS_B=${SCD_NETNS_PREFIX:-scd}-b
DEV_A=scd-veth-a
DEV_B=scd-veth-b
IP_A=10.77.0.1
IP_B=10.77.0.2
# The control links' host ends are in the host's namespace, so their names carry the prefix.
CTL_HOST_A=${NS_A}h
CTL_HOST_B=${NS_B}h
CTL_DEV=scd-ctl
# Where `up` keeps the data link's shaping for `heal`.
STATE=/run/scd-netns-${SCD_NETNS_PREFIX:-scd}

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
    # A veth pair goes with either end, but a namespace is torn down in the background: the
    # host's ends are deleted now so that an `up` right after finds their names free.
    ip link del "$CTL_HOST_A" 2>/dev/null || true
    ip link del "$CTL_HOST_B" 2>/dev/null || true
    ip netns del "$NS_A" 2>/dev/null || true
    ip netns del "$NS_B" 2>/dev/null || true
    rm -f "$STATE"
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
    echo "$rate $delay" > "$STATE"
    echo "netns-link: $NS_A ($IP_A) <-> $NS_B ($IP_B), rate $rate, one-way delay $delay"
}

control() {
    ip netns list | grep -qw "$NS_A" || die "no link: run up first"
    local side host ns net
    for side in a b; do
        if [[ $side == a ]]; then host=$CTL_HOST_A ns=$NS_A net=10.78.1
        else host=$CTL_HOST_B ns=$NS_B net=10.78.2; fi
        ip link add "$host" type veth peer name "$CTL_DEV" netns "$ns"
        ip addr add "$net.1/24" dev "$host"
        ip link set "$host" up
        ip -n "$ns" addr add "$net.2/24" dev "$CTL_DEV"
        ip -n "$ns" link set "$CTL_DEV" up
    done
    echo "netns-link: control links host 10.78.1.1 <-> $NS_A 10.78.1.2, host 10.78.2.1 <-> $NS_B 10.78.2.2"
}

# The two ends of LINK as "namespace:device" ("-" is the host's namespace).
ends() {
    case "$1" in
        data) echo "$NS_A:$DEV_A $NS_B:$DEV_B" ;;
        ctl-a) echo "-:$CTL_HOST_A $NS_A:$CTL_DEV" ;;
        ctl-b) echo "-:$CTL_HOST_B $NS_B:$CTL_DEV" ;;
        *) die "unknown link '$1' (data, ctl-a or ctl-b)" ;;
    esac
}

in_ns() {
    local ns=$1; shift
    if [[ $ns == - ]]; then "$@"; else ip netns exec "$ns" "$@"; fi
}

cut() {
    local link=${1:?usage: cut data|ctl-a|ctl-b} end
    # A zero-byte fifo as the root queue drops every packet sent: the device stays up, so
    # neither side is told (as when a switch between them fails).
    for end in $(ends "$link"); do
        in_ns "${end%%:*}" tc qdisc replace dev "${end##*:}" root bfifo limit 0
    done
    echo "netns-link: $link cut"
}

heal() {
    local link=${1:?usage: heal data|ctl-a|ctl-b} end ns dev
    for end in $(ends "$link"); do
        ns=${end%%:*} dev=${end##*:}
        in_ns "$ns" tc qdisc del dev "$dev" root 2>/dev/null || true
        if [[ $link == data ]]; then
            [[ -f $STATE ]] || die "the data link's shaping is unknown ($STATE missing)"
            read -r rate delay < "$STATE"
            shape "$ns" "$dev" "$rate" "$delay"
        fi
    done
    echo "netns-link: $link healed"
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
    control) control ;;
    cut) shift; cut "$@" ;;
    heal) shift; heal "$@" ;;
    *) die "usage: $0 up RATE DELAY | down | status | check | control | cut LINK | heal LINK" ;;
esac
