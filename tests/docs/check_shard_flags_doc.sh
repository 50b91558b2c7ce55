#!/usr/bin/env bash
# Fails, showing the difference, when docs/shard-flags.md is not what
# `layercast-shard --help` prints. Usage: check_shard_flags_doc.sh BINARY
set -euo pipefail
want=$(mktemp)
trap 'rm -f "$want"' EXIT
"$1" --help > "$want"
if ! diff -u <(sed -n '/^```$/,/^```$/p' docs/shard-flags.md | sed '1d;$d') "$want"; then
  echo "docs/shard-flags.md is out of date: run scripts/shard-flags-doc.sh" >&2
  exit 1
fi
echo "docs/shard-flags.md matches layercast-shard --help"
