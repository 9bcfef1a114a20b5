#!/usr/bin/env bash
# Build the CPU image where Docker Hub cannot be reached, in one command (as root):
#   apt-get install -y buildah debootstrap && bash containers/build.sh
# 1. The base: Debian bookworm from Debian's own packages, debootstrapped into a scratch container and committed to
#    buildah's store as $BASE (about a minute); made once, later builds find it there.
# 2. The image: containers/Dockerfile.cpu with `buildah bud --isolation chroot --layers` (the chroot shares the host's
#    network, so apt and pip inside reach the same registries; the layer cache makes an unchanged rebuild take
#    seconds). From the host it mounts, never copies: the torch==2.13.0+cpu wheel ($WHEELS), the CA bundle pip needs
#    behind this machine's registry proxy ($CA). Each is skipped when absent.
# Run it with buildah (podman run fails on these machines): see containers/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${IMAGE:-localhost/molt-lightning:cpu}
BASE=${BASE:-localhost/debian:bookworm-minbase}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
WHEELS=${WHEELS:-/opt/wheels}
CA=${CA:-/etc/ssl/certs/ca-certificates.crt}

if ! buildah inspect --type image "$BASE" >/dev/null 2>&1; then
  ctr=$(buildah from scratch)
  trap 'buildah rm "$ctr" >/dev/null' EXIT
  debootstrap --variant=minbase bookworm "$(buildah mount "$ctr")" "$MIRROR"
  buildah umount "$ctr" >/dev/null
  buildah commit --quiet "$ctr" "$BASE"
fi

host=()
if compgen -G "$WHEELS/torch-2.13.0+cpu-*.whl" >/dev/null; then
  host+=(--volume "$WHEELS:/wheels:ro" --build-arg WHEELS=/wheels)
fi
if [ -f "$CA" ]; then
  host+=(--volume "$CA:/host-ca.crt:ro" --build-arg PIP_CA=/host-ca.crt)
fi
buildah bud --isolation chroot --layers --build-arg BASE="$BASE" "${host[@]}" \
  -f containers/Dockerfile.cpu --ignorefile containers/Dockerfile.cpu.dockerignore -t "$IMAGE" .
