#!/usr/bin/env bash
# Build Baton's image with podman, here, where no container registry is reachable: the base
# image is made from Debian's archive with debootstrap (once), the build runs FROM it with
# --pull=never, and pip inside the build reaches the package registries as the host does.
# Each step is skipped when already done. Prints the image's name and size.
#   deploy/build_image.sh [--demo] [extra podman build args...]
#   BATON_IMAGE (default localhost/baton:VERSION), BATON_BASE_IMAGE, BATON_WHEELS (default /opt/wheels)
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
image=${BATON_IMAGE:-localhost/baton:$version}
base=${BATON_BASE_IMAGE:-localhost/baton-base:bookworm}
work=build/image
mkdir -p "$work"
args=()
if [ "${1:-}" = "--demo" ]; then
    shift; image=${BATON_IMAGE:-localhost/baton:$version-demo}; args+=(--build-arg BAKE_DEMO_MODEL=1)
fi

sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo -n"
if ! command -v podman >/dev/null || ! command -v runc >/dev/null || ! command -v debootstrap >/dev/null; then
    echo "installing podman, runc, debootstrap" >&2
    $sudo apt-get install -y -q podman runc debootstrap >/dev/null \
        || { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q podman runc debootstrap >/dev/null; }
fi
# This kind of VM: no rlimit changes allowed in containers, crun fails on its hybrid cgroups.
printf '[containers]\ndefault_ulimits = []\n' > "$work/containers.conf"
export CONTAINERS_CONF=$PWD/$work/containers.conf
podman=(podman --storage-driver vfs --runtime runc --cgroup-manager cgroupfs)

if ! "${podman[@]}" image exists "$base"; then
    echo "making the base image $base from Debian's archive (about a minute)" >&2
    rootfs=$work/rootfs
    $sudo rm -rf "$rootfs"
    $sudo debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" >/dev/null
    $sudo tar -C "$rootfs" -c . | "${podman[@]}" import - "$base" >/dev/null
    $sudo rm -rf "$rootfs"
fi

# The host's CA bundle, so that pip inside the build trusts the registries as the host does;
# a local wheel folder (the CPU torch here) when there is one, torch's own index otherwise.
ca=/etc/ssl/certs/ca-certificates.crt
[ -f "$ca" ] && args+=(-v "$ca:$ca:ro")
wheels=${BATON_WHEELS:-/opt/wheels}
if [ -d "$wheels" ]; then
    args+=(-v "$wheels:/wheels:ro" --build-arg PIP_FIND_LINKS=/wheels --build-arg TORCH_INDEX_URL=)
fi
t0=$SECONDS
"${podman[@]}" build --pull=never --network host --build-arg BASE="$base" "${args[@]}" "$@" \
    -f deploy/Containerfile -t "$image" . >&2
# With vfs storage every step is a full copy: drop the images a rebuild left untagged.
"${podman[@]}" image prune -f >/dev/null
size=$("${podman[@]}" image inspect "$image" --format '{{.Size}}')
echo "built in $((SECONDS - t0))s" >&2
echo "$image $((size / 1048576)) MiB"
