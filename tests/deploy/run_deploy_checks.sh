#!/usr/bin/env bash
# Offline checks of deploy/ (no cluster, no Docker engine):
#  1. kubectl kustomize renders the base and the example, training and relay
#     overlays;
#  2. deploy/validate checks every rendered object against the Kubernetes and
#     Prometheus Operator schemas (strict about field names) and across
#     objects (headless Service, probe ports, shard count, memory, drain...,
#     and the relay's listen addresses, probes, Service, PDB, PodMonitor and
#     NetworkPolicy);
#  3. yamllint, on the sources and on the rendered manifests;
#  4. the Dockerfile: named stages, existing sources and scripts, non-root
#     USER, ENTRYPOINT layercast-shard, ports 7070 and 9090 exposed, OCI
#     labels, runtime libraries complete (tests/deploy/image_test.sh builds
#     the image and checks its configuration with the same validator);
#  5. the Docker build stage's configure step, run outside Docker on exactly
#     the files the Dockerfile copies;
#  6. negative tests: broken manifests (the example's and the relay
#     overlay's), fixtures, Dockerfiles and built-image configurations must
#     fail.
# LAYERCAST_BIN_DIR: where layercast-shard and layercast were built (default
# build/bin) for the runtime-library check. Exits non-zero on any failure.
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
bin_dir=${LAYERCAST_BIN_DIR:-$root/build/bin}
[ -x "$bin_dir/layercast-shard" ] && [ -x "$bin_dir/layercast" ] || bin_dir=
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

passed=0
failed=0
skipped=0
step() {  # step NAME COMMAND...: runs it, counts it
  local name=$1
  shift
  echo "== $name"
  if "$@"; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
    echo "FAILED: $name"
  fi
}

# kubectl is not a Debian bookworm package: it comes with the machine image
# (or Kubernetes' own apt repository). The rest install with the project.
missing=()
for tool in kubectl node npm yamllint; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "missing tools: ${missing[*]} (scripts/install-deps.sh installs yamllint, nodejs and npm;" \
    "kubectl comes from the machine image or https://pkgs.k8s.io)"
  echo "deploy: 0 passed, 1 failed"
  exit 1
fi
echo "kubectl $(kubectl version --client 2>/dev/null | head -1 | awk '{print $3}'), node $(node --version)," \
  "$(yamllint --version)"

# npm ci only when package-lock.json changed since the last install.
npm_install() {
  local stamp=deploy/validate/node_modules/.lock-sha256
  local want
  want=$(sha256sum deploy/validate/package-lock.json | cut -d' ' -f1)
  if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    echo "node_modules matches package-lock.json"
    return 0
  fi
  (cd deploy/validate && npm ci --no-audit --no-fund --loglevel=error) && echo "$want" >"$stamp"
}
step "npm ci (deploy/validate)" npm_install

step "kubectl kustomize deploy/k8s/base" sh -c "kubectl kustomize deploy/k8s/base > '$tmp/base.yaml'"
step "kubectl kustomize deploy/k8s/overlays/example" \
  sh -c "kubectl kustomize deploy/k8s/overlays/example > '$tmp/example.yaml'"
step "kubectl kustomize deploy/k8s/overlays/training" \
  sh -c "kubectl kustomize deploy/k8s/overlays/training > '$tmp/training.yaml'"
step "kubectl kustomize deploy/k8s/overlays/relay" \
  sh -c "kubectl kustomize deploy/k8s/overlays/relay > '$tmp/relay.yaml'"

step "validate rendered manifests (schemas, field names, cross-object, memory by dry run)" \
  node deploy/validate/validate.mjs --repo "$root" \
  ${bin_dir:+--shard-binary "$bin_dir/layercast-shard"} "$tmp/base.yaml" "$tmp/example.yaml" \
  "$tmp/training.yaml" "$tmp/relay.yaml"

step "yamllint deploy/ tests/deploy/ and the rendered manifests" \
  yamllint -c deploy/.yamllint deploy tests/deploy "$tmp/base.yaml" "$tmp/example.yaml" \
  "$tmp/training.yaml" "$tmp/relay.yaml"

step "Dockerfile" node deploy/validate/dockerfile.mjs --repo "$root" ${bin_dir:+--bin-dir "$bin_dir"} \
  deploy/docker/Dockerfile

# The build stage's `cmake -S . ...` configure, on a copy of only what the
# Dockerfile copies: a source folder the Dockerfile forgets fails here.
configure_docker_context() {  # configure_docker_context DOCKERFILE
  local ctx line configure=
  ctx=$(mktemp -d -p "$tmp")
  while IFS= read -r line; do
    case $line in
      "COPY "*) mkdir -p "$ctx/$(dirname "${line#COPY }")" && cp -r "${line#COPY }" "$ctx/${line#COPY }" ;;
      "RUN cmake -S "*) configure=${line#RUN } && configure=${configure%% && *} ;;
    esac
  done < <(node deploy/validate/dockerfile.mjs --print-build-stage "$1")
  [ -n "$configure" ] || { echo "no 'RUN cmake -S ...' in the build stage"; return 1; }
  echo "$configure"
  (cd "$ctx" && bash -c "$configure" >"$ctx.log" 2>&1) || { grep -m3 -A2 "CMake Error" "$ctx.log"; return 1; }
}
# Its negative test: the same Dockerfile without `COPY client client`.
configure_without_client_fails() {
  sed '/^COPY client client$/d' deploy/docker/Dockerfile >"$tmp/Dockerfile.no-client"
  ! configure_docker_context "$tmp/Dockerfile.no-client"
}
if command -v cmake >/dev/null && command -v ninja >/dev/null; then
  step "Docker build stage: configure on the Dockerfile's context only" \
    configure_docker_context deploy/docker/Dockerfile
  step "negative: that configure fails when the Dockerfile forgets client/" configure_without_client_fails
else
  echo "== skipped: Docker build stage configure (cmake or ninja missing; scripts/install-deps.sh installs them)"
  skipped=$((skipped + 2))
fi

# Negative tests count one by one.
echo "== negative tests"
node tests/deploy/negative.mjs "$tmp/example.yaml" ${bin_dir:+"$bin_dir"} | tee "$tmp/negative.log"
read -r neg_passed neg_failed < <(sed -n 's/^negative: \([0-9]*\) passed, \([0-9]*\) failed$/\1 \2/p' "$tmp/negative.log")
if [ -z "${neg_passed:-}" ]; then
  neg_passed=0 neg_failed=1  # it crashed before its summary
fi
passed=$((passed + neg_passed))
failed=$((failed + neg_failed))

echo "deploy: $passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
