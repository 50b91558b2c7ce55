#!/usr/bin/env bash
# Builds deploy/docker/Dockerfile for real and runs what the image holds.
#  1. Base images: no container registry is reachable from CI machines, but
#     Debian's archive is. So debian:bookworm is `debootstrap --variant=minbase
#     bookworm`, imported with `podman import`; debian:bookworm-slim is the
#     same tree without documentation, man pages and locales, and with dpkg
#     told to leave them out of later installs (as the official slim image
#     does). Both tarballs are cached.
#  2. `podman build --isolation chroot` from the repository root. Why chroot:
#     `podman run` cannot start containers on these machines (the OCI runtime
#     may not set resource limits: "OCI permission denied"), and a build with
#     the default isolation runs each RUN step in such a container; chroot
#     isolation runs them without one. Storage: overlay where the kernel
#     mounts it, else vfs (see below); the layers stay cached between runs.
#  3. The image's configuration (podman image inspect) against the
#     Dockerfile: user, entrypoint, ports, OCI labels (deploy/validate).
#  4. The runtime image run without a container runtime: a container's file
#     system (podman create + mount, so the image stays untouched), /proc,
#     /dev and /sys mounted as a runtime would and a model bind-mounted
#     read-only at /models, in a private mount namespace; then the image's
#     entrypoint started under `chroot --userspec=<the image's USER>` with the
#     image's environment. A worker built outside (LAYERCAST_BIN_DIR) fetches
#     a layer and checks it bit for bit against the model; /metrics is read;
#     the gRPC health check passes for the server and the ShardService; the
#     image's own `layercast` tool reads the manifest; SIGTERM stops the shard
#     with exit status 0.
# Traffic stays on 127.0.0.1 (ports chosen by the kernel). Every wait is
# bounded. Needs root. Exits 77 (ctest: skipped) when not root, or when
# podman or debootstrap is missing and cannot be installed; under CI
# (LAYERCAST_CI=1) those fail instead.
# Environment:
#   LAYERCAST_IMAGE_CACHE  base-image tarballs and podman's image store, kept
#                          between runs (default ~/.cache/layercast-image)
#   LAYERCAST_BIN_DIR      host-built layercast (default build/bin)
#   LAYERCAST_HEALTH_PROBE host-built health_probe (default build/tests/deploy/health_probe)
#   LAYERCAST_DEBIAN_MIRROR debootstrap's mirror, and the base images' apt
#                          source (default http://deb.debian.org/debian)
#   LAYERCAST_IMAGE_STORAGE_DRIVER  overlay or vfs (default: overlay if it mounts)
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
bin_dir=${LAYERCAST_BIN_DIR:-$repo/build/bin}
probe=${LAYERCAST_HEALTH_PROBE:-$repo/build/tests/deploy/health_probe}
cache=${LAYERCAST_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/layercast-image}
mirror=${LAYERCAST_DEBIAN_MIRROR:-http://deb.debian.org/debian}
image=localhost/layercast:test
build_image=localhost/layercast-build:test
started=$SECONDS

say() { echo "== [$((SECONDS - started))s] $*"; }
indent() { sed 's/^/   /' "$@"; }
fail() {
  echo "FAILED: $*"
  exit 1
}
# What this test needs from the machine (root, podman, debootstrap) is
# missing: a skip (77) on a developer's machine; under CI (LAYERCAST_CI=1,
# set by .ci/run), where scripts/install-deps.sh provides it, a failure.
skip() {
  [ "${LAYERCAST_CI:-0}" = 1 ] && fail "$* (a failure under CI, LAYERCAST_CI=1, not a skip)"
  echo "SKIPPED: $* (LAYERCAST_CI=1 makes this a failure)"
  exit 77
}

# --- tools -------------------------------------------------------------------
if [ "$(id -u)" -ne 0 ]; then
  # Rootless podman would need subordinate ids, and chroot --userspec needs root.
  skip "the image test needs root (podman's store, chroot --userspec); run it as root"
fi
if ! command -v podman >/dev/null || ! command -v debootstrap >/dev/null; then
  say "installing podman and debootstrap (scripts/install-deps.sh --image-tools)"
  if ! timeout 900 scripts/install-deps.sh --image-tools || ! command -v podman >/dev/null ||
    ! command -v debootstrap >/dev/null; then
    skip "podman or debootstrap is missing and cannot be installed" \
      "(scripts/install-deps.sh --image-tools failed)"
  fi
fi
for tool in node python3 curl unshare chroot; do
  command -v "$tool" >/dev/null || fail "$tool is missing (scripts/install-deps.sh installs it)"
done
[ -x "$bin_dir/layercast" ] || fail "no worker at $bin_dir/layercast: build the project first"
[ -x "$probe" ] || fail "no health probe at $probe: build the project first (target health_probe)"

mkdir -p "$cache"
# One run at a time per cache: the store and the tarballs are shared. (The
# shard is started without fd 9, so that it never holds the lock.)
exec 9>"$cache/lock"
flock -w 3600 9 || fail "another image test holds $cache/lock for over an hour"

# The storage driver: overlay where the kernel mounts overlayfs here (as
# root on ext4 or xfs), for its layers are differences (a 1.2 GB store);
# else vfs, which needs no overlay mounts but copies the whole file system
# into every layer and container: about 1 GB a step in the build stage, a
# 16-19 GB store, and about 3 minutes more per build here (each COPY 5-14 s,
# 2 minutes removing the build's containers). LAYERCAST_IMAGE_STORAGE_DRIVER
# chooses.
overlay_works() {
  local d
  d=$(mktemp -d -p "$cache")
  mkdir "$d/lower" "$d/upper" "$d/work" "$d/merged"
  local ok=1
  mount -t overlay overlay -o "lowerdir=$d/lower,upperdir=$d/upper,workdir=$d/work" "$d/merged" 2>/dev/null &&
    umount "$d/merged" && ok=0
  rm -rf "$d"
  return "$ok"
}
driver=${LAYERCAST_IMAGE_STORAGE_DRIVER:-}
if [ -z "$driver" ]; then
  if overlay_works; then driver=overlay; else driver=vfs; fi
fi
store=$cache/storage-$driver
# Podman's run-time state for that store (on tmpfs, so a reboot clears it).
runroot=/run/layercast-image-test-$(printf '%s' "$store" | sha256sum | cut -c1-12)
# podman with this test's own store, so it never meets other images.
pod=(podman --root "$store" --runroot "$runroot" --storage-driver "$driver"
  --cgroup-manager cgroupfs --events-backend file)

tmp=$(mktemp -d /tmp/layercast-image-test.XXXXXX)
shard_pid=
container=
cleanup() {
  if [ -n "$shard_pid" ] && kill -0 "$shard_pid" 2>/dev/null; then kill -KILL "$shard_pid" 2>/dev/null || true; fi
  if [ -n "$container" ]; then
    "${pod[@]}" umount "$container" >/dev/null 2>&1 || true
    "${pod[@]}" rm -f "$container" >/dev/null 2>&1 || true
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT

# A store podman cannot open (made with another run-time directory or by
# another podman version) is only a cache: start a new one.
if ! "${pod[@]}" info >/dev/null 2>"$tmp/info.err"; then
  say "podman cannot use $store ($(head -c 300 "$tmp/info.err")): starting a new store"
  { findmnt -rn -o TARGET | grep -F "$store/" || true; } | sort -r | while read -r mnt; do umount "$mnt" || true; done
  rm -rf "$store"
fi

# Containers a killed run left behind (each holds a copy of the image), and
# the build's working containers (buildah's, listed only with --external) of a
# build that was killed: these pin their images, so the prune after the build
# failed with "image is in use by a container". The lock above makes every
# container in this store a leftover.
for leftover in $("${pod[@]}" ps -a --external --format '{{.ID}}' 2>/dev/null); do
  "${pod[@]}" umount "$leftover" >/dev/null 2>&1 || true
  "${pod[@]}" rm -f "$leftover" >/dev/null 2>&1 || true
done

# --- 1. base images ----------------------------------------------------------
# The tree debootstrap leaves, tidied to look like Debian's official images:
# their apt sources, no host files, empty caches.
tidy_rootfs() {  # tidy_rootfs DIR
  local dir=$1
  rm -f "$dir/etc/apt/sources.list"
  cat >"$dir/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $mirror
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  : >"$dir/etc/resolv.conf"
  : >"$dir/etc/hostname"
  rm -rf "$dir"/var/lib/apt/lists/* "$dir"/var/cache/apt/*.bin "$dir"/var/cache/apt/archives/*.deb \
    "$dir"/var/log/*.log "$dir"/var/log/apt/* "$dir"/tmp/* "$dir"/root/.bash_history
}

# As the official slim variant: documentation, man pages and locales gone,
# and dpkg told to skip them in every later install.
slim_rootfs() {  # slim_rootfs DIR
  local dir=$1
  cat >"$dir/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
# As Debian's official -slim images: no documentation, man pages or locales.
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/man/*
EOF
  find "$dir/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
  find "$dir/usr/share/doc" -mindepth 1 -type d -empty -delete
  rm -rf "$dir"/usr/share/{groff,info,linda,lintian,locale,man}/*
}

import_base() {  # import_base TARBALL NAME: as the official image's config
  "${pod[@]}" import --quiet --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' "$1" "$2" >/dev/null
}

make_base_tarballs() {
  local rootfs=$tmp/rootfs
  say "debootstrap --variant=minbase bookworm ($mirror)"
  timeout 1200 debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$tmp/debootstrap.log" 2>&1 ||
    { tail -20 "$tmp/debootstrap.log"; fail "debootstrap failed (log above)"; }
  tidy_rootfs "$rootfs"
  # Device nodes, /proc and /sys come from the runtime, not the image.
  local excludes=(--exclude=./dev/* --exclude=./proc/* --exclude=./sys/*)
  tar --numeric-owner -C "$rootfs" "${excludes[@]}" -cf "$cache/bookworm.tar.tmp" .
  slim_rootfs "$rootfs"
  tar --numeric-owner -C "$rootfs" "${excludes[@]}" -cf "$cache/bookworm-slim.tar.tmp" .
  mv "$cache/bookworm.tar.tmp" "$cache/bookworm.tar"
  mv "$cache/bookworm-slim.tar.tmp" "$cache/bookworm-slim.tar"
  rm -rf "$rootfs"
}

# Named as the Dockerfile's FROM lines resolve (docker.io/library/...), so a
# build never looks for them elsewhere.
if "${pod[@]}" image exists docker.io/library/debian:bookworm &&
  "${pod[@]}" image exists docker.io/library/debian:bookworm-slim; then
  say "base images debian:bookworm and debian:bookworm-slim: cached in $store"
else
  if [ -f "$cache/bookworm.tar" ] && [ -f "$cache/bookworm-slim.tar" ]; then
    say "base images: importing the cached debootstrap tarballs from $cache"
  else
    make_base_tarballs
  fi
  import_base "$cache/bookworm.tar" docker.io/library/debian:bookworm
  import_base "$cache/bookworm-slim.tar" docker.io/library/debian:bookworm-slim
fi
base_done=$SECONDS

# --- 2. the build ------------------------------------------------------------
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
build_args=(--isolation chroot --pull=never --layers --label "org.opencontainers.image.revision=$revision"
  --ignorefile deploy/docker/Dockerfile.dockerignore -f deploy/docker/Dockerfile)
say "podman build --isolation chroot -f deploy/docker/Dockerfile -t $image . (revision $revision, storage $driver)"
build_started=$SECONDS
stamp() {  # each line prefixed with the seconds since the build started
  local line
  while IFS= read -r line; do printf '%4ds %s\n' "$((SECONDS - build_started))" "$line"; done
}
if ! timeout 1800 "${pod[@]}" build "${build_args[@]}" -t "$image" . 2>&1 | stamp >"$tmp/build.log"; then
  tail -60 "$tmp/build.log"
  fail "podman build failed (the log's end above)"
fi
build_seconds=$((SECONDS - build_started))
grep -E '^ *[0-9]+s (\[[0-9]/[0-9]\] )?(STEP [0-9]+/[0-9]+|--> Using cache|Successfully tagged)' "$tmp/build.log" |
  cut -c1-150 | indent
# The build stage's last layer (the line before the runtime stage's first
# step), tagged for its size.
build_stage_id=$(grep -B1 -m1 '\[2/[0-9]*\] STEP 1/' "$tmp/build.log" | sed -n 's/^ *[0-9]*s --> \([0-9a-f]*\)$/\1/p')
[ -n "$build_stage_id" ] || fail "no build stage image in the build's log"
"${pod[@]}" tag "$build_stage_id" "$build_image"
# Images of earlier runs' sources, untagged now, would fill the disk.
# Only housekeeping: an image it cannot remove is left for the next run.
"${pod[@]}" image prune -f >/dev/null 2>"$tmp/prune.err" ||
  say "image prune left some images ($(head -c 300 "$tmp/prune.err")); continuing"
say "built in ${build_seconds}s; sizes:"
"${pod[@]}" image ls --format '   {{.Repository}}:{{.Tag}}  {{.Size}}' | grep -E "layercast|debian" || true
du -sh "$store" | indent

# --- 3. the image's configuration ---------------------------------------------
"${pod[@]}" image inspect "$image" >"$tmp/inspect.json"
say "image configuration against the Dockerfile (deploy/validate/dockerfile.mjs --image-inspect)"
node deploy/validate/dockerfile.mjs --repo "$repo" --image-inspect "$tmp/inspect.json" \
  --revision "$revision" deploy/docker/Dockerfile || fail "the built image does not match the Dockerfile"
config() {  # config FIELD: one field of the image's config, as JSON lines
  node -e 'const c = JSON.parse(require("fs").readFileSync(process.argv[1]))[0].Config;
    const v = c[process.argv[2]]; for (const x of Array.isArray(v) ? v : [v]) console.log(x ?? "")' \
    "$tmp/inspect.json" "$1"
}
user=$(config User)
mapfile -t entrypoint < <(config Entrypoint)
mapfile -t image_env < <(config Env)

# --- 4. run it -----------------------------------------------------------------
python3 tests/deploy/image_test_model.py write "$tmp/model" | indent
chmod 0755 "$tmp" "$tmp/model"
chmod 0644 "$tmp/model/model.safetensors"

container=$("${pod[@]}" create --name "layercast-image-test-$$" "$image")
rootfs=$("${pod[@]}" mount "$container")
mkdir -p "$rootfs/models"
say "container file system at $rootfs; user $user; entrypoint ${entrypoint[*]}"

# in_image LIMIT COMMAND...: sets `run` to the command line that runs
# COMMAND from the image's PATH, in its file system, as its USER, with its
# environment and the model at /models (read-only), killed after LIMIT
# seconds (0: never). Each step execs the next: started as `"${run[@]}" &`,
# $! is COMMAND's pid, and COMMAND gets the signals sent to it.
in_image() {
  local limit=$1
  shift
  # shellcheck disable=SC2016  # expanded by the inner bash
  run=(unshare --mount --propagation private -- bash -c '
    set -e
    root=$1 model=$2 user=$3 limit=$4 nenv=$5
    shift 5
    env=("${@:1:nenv}")
    shift "$nenv"
    mount -t proc proc "$root/proc"
    mount --rbind /dev "$root/dev"
    mount --rbind /sys "$root/sys"
    mount --bind "$model" "$root/models"
    mount -o remount,bind,ro "$root/models"
    bound=()
    [ "$limit" = 0 ] || bound=(timeout -s KILL "$limit")
    exec "${bound[@]}" env -i "${env[@]}" chroot --userspec="$user" "$root" "$@"
  ' in_image "$rootfs" "$tmp/model" "$user" "$limit" "${#image_env[@]}" "${image_env[@]}" "$@")
}

# The image's entrypoint with the flags a StatefulSet would give, on loopback.
in_image 0 "${entrypoint[@]}" --listen 127.0.0.1:0 --port-file /tmp/shard.port \
  --metrics-listen 127.0.0.1:0 --model /models/model.safetensors --shard-index 0 --num-shards 1
"${run[@]}" >"$tmp/shard.log" 2>&1 9>&- &
shard_pid=$!
say "started ${entrypoint[*]} from the image (pid $shard_pid)"
shard_failed() {  # shard_failed MESSAGE: the shard's log, then fail
  indent "$tmp/shard.log"
  fail "$1"
}

port=
for _ in $(seq 300); do  # 30 s
  kill -0 "$shard_pid" 2>/dev/null || shard_failed "the shard exited at start (its log above)"
  port=$(cat "$rootfs/tmp/shard.port" 2>/dev/null || true)
  [ -n "$port" ] && break
  sleep 0.1
done
[ -n "$port" ] || shard_failed "the shard wrote no port file within 30 s"
metrics_port=$(sed -n 's/.*metrics on 127\.0\.0\.1:\([0-9]*\).*/\1/p' "$tmp/shard.log" | head -1)
[ -n "$metrics_port" ] || shard_failed "the shard logged no 'metrics on 127.0.0.1:PORT'"

# The process: the image's binary, its user, its root.
read -r _ uid _ < <(grep '^Uid:' "/proc/$shard_pid/status")
read -r _ gid _ < <(grep '^Gid:' "/proc/$shard_pid/status")
[ "$uid:$gid" = "$user" ] || fail "the shard runs as $uid:$gid, not the image's USER $user"
[ "$(readlink "/proc/$shard_pid/root")" = "$rootfs" ] || fail "the shard's root is not the image's file system"
echo "   pid $shard_pid runs $(readlink "/proc/$shard_pid/exe") as $uid:$gid, root $rootfs"

say "gRPC health check (grpc.health.v1) on 127.0.0.1:$port"
ready=0
for _ in $(seq 120); do  # 60 s for the model to load
  if "$probe" "127.0.0.1:$port" layercast.v1.ShardService >"$tmp/probe.txt" 2>&1; then
    ready=1
    break
  fi
  kill -0 "$shard_pid" 2>/dev/null || shard_failed "the shard exited while loading"
  sleep 0.5
done
indent "$tmp/probe.txt"
[ "$ready" = 1 ] || shard_failed "readiness (layercast.v1.ShardService) not SERVING within 60 s"
"$probe" "127.0.0.1:$port" >"$tmp/probe.txt" 2>&1 || { indent "$tmp/probe.txt"; fail "liveness (service \"\") is not SERVING"; }
indent "$tmp/probe.txt"

say "a worker outside the image: layercast fetch --layer 1, checked bit for bit"
timeout 60 "$bin_dir/layercast" fetch --shards "127.0.0.1:$port" --layer 1 \
  --out "$tmp/layer1.safetensors" --timeout-ms 30000 >"$tmp/fetch.txt" 2>&1 ||
  { indent "$tmp/fetch.txt"; shard_failed "layercast fetch failed"; }
indent "$tmp/fetch.txt"
python3 tests/deploy/image_test_model.py check "$tmp/model/model.safetensors" \
  "$tmp/layer1.safetensors" model.layers.0 >"$tmp/check.txt" 2>&1 ||
  { indent "$tmp/check.txt"; fail "the fetched layer differs from the model"; }
indent "$tmp/check.txt"

say "the image's own worker tool: layercast manifest"
in_image 60 layercast manifest --shards "127.0.0.1:$port"
"${run[@]}" >"$tmp/manifest.txt" 2>&1 9>&- ||
  { indent "$tmp/manifest.txt"; fail "the image's layercast manifest failed"; }
head -4 "$tmp/manifest.txt" | indent
grep -q "model.layers.1" "$tmp/manifest.txt" || fail "the manifest names no layer model.layers.1"

say "/metrics on 127.0.0.1:$metrics_port"
curl -sf --max-time 10 "http://127.0.0.1:$metrics_port/metrics" >"$tmp/metrics.txt" ||
  fail "GET /metrics failed"
metric() { awk -v m="$1" '$1 == m { print $2 }' "$tmp/metrics.txt"; }
elements=$((384 + 384 * 384 + 1031 * 384))  # model.layers.0 (image_test_model.py)
for want in "layercast_ready 1" "layercast_layers 4" "layercast_sent_parameters_total $elements" \
  'layercast_rpcs_total{code="OK",method="FetchLayer"} 1'; do
  got=$(metric "${want% *}")
  [ "$got" = "${want##* }" ] || fail "/metrics: ${want% *} is '$got', expected ${want##* }"
  echo "   ${want% *} $got"
done

say "SIGTERM"
kill -TERM "$shard_pid"
for _ in $(seq 300); do  # 30 s; bash reaps the shard and keeps its status for wait
  kill -0 "$shard_pid" 2>/dev/null || break
  sleep 0.1
done
kill -0 "$shard_pid" 2>/dev/null && shard_failed "the shard still runs 30 s after SIGTERM"
status=0
wait "$shard_pid" || status=$?
shard_pid=
tail -3 "$tmp/shard.log" | indent
[ "$status" = 0 ] || shard_failed "the shard exited with status $status after SIGTERM"

say "passed: base images $((base_done - started))s, build ${build_seconds}s, total $((SECONDS - started))s"
