#!/usr/bin/env bash
# Runs docs/operations.md's shell blocks in order, as one script, the way a
# new operator would paste them: against the built binaries, on free
# loopback ports, within a time limit; fails when a step fails or the
# walkthrough does not show what the page says it shows.
# Usage: operations_walkthrough.sh BIN_DIR
set -euo pipefail
bin=$1
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
sed -n '/^```sh$/,/^```$/p' docs/operations.md | sed '/^```/d' > "$work/walkthrough.sh"
# Four free ports: BASE, BASE+1, BASE+10, BASE+11.
base=$(python3 - <<'PY'
import random, socket
for _ in range(200):
    base = random.randrange(20000, 60000)
    try:
        for port in (base, base + 1, base + 10, base + 11):
            s = socket.socket(); s.bind(("127.0.0.1", port)); s.close()
        print(base)
        break
    except OSError:
        pass
PY
)
BIN=$bin BASE=$base timeout 120 bash -e "$work/walkthrough.sh" > "$work/out" 2>&1 || {
  status=$?
  cat "$work/out"
  echo "docs/operations.md: the walkthrough failed (exit $status)" >&2
  exit 1
}
for expected in "version   0" "layercast_ready 1" "  shard 1  127.0.0.1:$((base + 1))  version 0"; do
  if ! grep -qF -- "$expected" "$work/out"; then
    cat "$work/out"
    echo "docs/operations.md: the walkthrough did not show '$expected'" >&2
    exit 1
  fi
done
# Shard 0 once, shard 1 twice (restarted).
if [ "$(grep -c 'layercast-shard: stopped' "$work/out")" -ne 3 ]; then
  cat "$work/out"
  echo "docs/operations.md: the shards did not each log 'stopped'" >&2
  exit 1
fi
echo "docs/operations.md: the walkthrough ran as written"
