#!/usr/bin/env bash
# Writes docs/shard-flags.md from `layercast-shard --help`, whose text comes
# from the (help) options of proto/layercast/v1/config.proto: one source for
# the proto, the flags and the docs. tests/docs checks the file is current.
# Usage: scripts/shard-flags-doc.sh [BUILD_DIR]   (default build)
set -euo pipefail
cd "$(dirname "$0")/.."
binary=${1:-build}/bin/layercast-shard
{
  echo "# layercast-shard flags"
  echo
  echo "Every flag is also a field of the JSON config (\`--config FILE.json\`,"
  echo "\`layercast.v1.ShardConfig\`). Generated from \`layercast-shard --help\` by"
  echo "\`scripts/shard-flags-doc.sh\`; the text lives in the \`(help)\` option of each"
  echo "field of \`proto/layercast/v1/config.proto\`."
  echo
  echo '```'
  "$binary" --help
  echo '```'
} > docs/shard-flags.md
