#!/bin/bash
# Runs a benchmark with its loopback traffic limited to RATE, as a network
# link of that speed would limit it, instead of by the CPU that copies the
# bytes: in a network namespace of its own (nothing outside it is touched)
# whose loopback device passes packets through a token bucket (tc tbf).
#
#   bench/wire_limited.sh RATE COMMAND [ARG...]
#   bench/wire_limited.sh 8gbit build/bench/gather_bench --fp8 --repeat 5
#
# RATE is tc's: 8gbit, 500mbit, 1gbps (bytes). Every packet crosses
# loopback once, so shards and workers share RATE as they would share one
# link. Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2's ip and
# tc (Debian: apt-get install iproute2).
set -euo pipefail

if [ $# -lt 2 ]; then
  echo "usage: $0 RATE COMMAND [ARG...]   (e.g. $0 8gbit build/bench/gather_bench --fp8)" >&2
  exit 2
fi
rate=$1
shift
for tool in ip tc unshare; do
  if ! command -v "$tool" >/dev/null; then
    echo "$0: $tool is missing: apt-get install iproute2 util-linux" >&2
    exit 2
  fi
done

# A 4 MB bucket (a few milliseconds at multi-Gbit rates, longer below)
# holds more than one timer tick's worth of bytes, which tbf needs to reach
# RATE, and 200 ms of queue keeps gRPC's windows from seeing drops.
exec unshare --net -- bash -c '
  set -euo pipefail
  ip link set lo up
  tc qdisc add dev lo root tbf rate "$1" burst 4mb latency 200ms
  echo "wire_limited: loopback in a new network namespace, $(tc qdisc show dev lo)" >&2
  shift
  exec "$@"
' wire_limited "$rate" "$@"
