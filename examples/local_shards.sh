# Sourced by the examples' scripts (bash): checks the build tree, makes a
# working directory ($work), and start_shards N FLAG... starts N
# layercast-shard processes on 127.0.0.1 with those flags (the shard index
# and count added), waits for their ports and sets $shards to their
# host:port list. The shards are stopped (SIGTERM) when the script exits.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
shard=build/bin/layercast-shard
[ -x "$shard" ] && [ -d build/python/layercast ] || {
  echo "build first: cmake -S . -B build && cmake --build build -j2 --target programs" >&2; exit 1; }
work=$(mktemp -d)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT
export PYTHONPATH=build/python

start_shards() {
  local n=$1 i
  shift
  for ((i = 0; i < n; i++)); do
    "$shard" --shard-index $i --num-shards "$n" --listen 127.0.0.1:0 \
      --port-file "$work/port-$i" "$@" 2> "$work/shard-$i.log" &
    pids+=($!)
  done
  shards=""
  for ((i = 0; i < n; i++)); do
    for _ in $(seq 600); do [ -s "$work/port-$i" ] && break; sleep 0.1; done
    [ -s "$work/port-$i" ] || { echo "shard $i did not start: see $work/shard-$i.log" >&2; exit 1; }
    shards+="${shards:+,}127.0.0.1:$(cat "$work/port-$i")"
  done
}
