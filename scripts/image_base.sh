#!/usr/bin/env bash
# Makes the Debian 12 base image that scripts/image.sh builds on when no registry is reachable:
# debootstrap (minbase) from this machine's Debian mirror, the apt sources and the slim
# image's dpkg excludes of debian:bookworm-slim, imported into buildah's store as one layer.
# Idempotent: an image of that name already in the store is kept.
#
#   scripts/image_base.sh [IMAGE]   (default localhost/tessera-debian:bookworm)
#
# Environment:
#   DEBIAN_MIRROR   the mirror to debootstrap from (default: the first Debian URI in
#                   /etc/apt/sources.list*, else http://deb.debian.org/debian)
set -euo pipefail
image="${1:-localhost/tessera-debian:bookworm}"
log() { echo "image_base: $*" >&2; }

if buildah inspect --type image "$image" >/dev/null 2>&1; then
  log "$image is already in the store"
  exit 0
fi

# The mirror apt uses here: a deb822 "URIs:" line or a one-line "deb URI bookworm" entry.
find_mirror() {
  local uri
  uri=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list \
          2>/dev/null | sed -n -e 's|^URIs: *\(\S*/debian\)/*$|\1|p' \
                                -e 's|^deb \(\[[^]]*\] \)\?\(\S*/debian\)/* bookworm .*|\2|p' |
        head -n 1)
  echo "${uri:-http://deb.debian.org/debian}"
}
mirror="${DEBIAN_MIRROR:-$(find_mirror)}"
security="${mirror%/debian}/debian-security"

rootfs=$(mktemp -d /var/tmp/tessera-rootfs.XXXXXX)
ctr=""
cleanup() {
  [[ -n "$ctr" ]] && buildah rm "$ctr" >/dev/null 2>&1
  rm -rf "$rootfs" "$rootfs.tar"
}
trap cleanup EXIT

log "debootstrap bookworm (minbase) from $mirror"
debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >&2

# As debian:bookworm does: main, updates and security, in deb822 form.
rm -f "$rootfs/etc/apt/sources.list"
cat >"$rootfs/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $mirror
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
# As the slim images do: no docs, man pages or locales from later installs; no apt caches.
cat >"$rootfs/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/locale/*
EOF
cat >"$rootfs/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
  "$rootfs"/usr/share/doc/*/changelog* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/*
# Files installed before the excludes existed.
find "$rootfs/usr/share/doc" -mindepth 2 ! -name copyright -delete 2>/dev/null || true
find "$rootfs/usr/share/locale" -mindepth 1 -delete 2>/dev/null || true

tar -C "$rootfs" --numeric-owner -cf "$rootfs.tar" .
ctr=$(buildah from scratch)
buildah add "$ctr" "$rootfs.tar" / >/dev/null
rm -f "$rootfs.tar"
buildah config --cmd /bin/bash --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  "$ctr"
buildah commit --rm "$ctr" "$image" >/dev/null
ctr=""
log "made $image ($(buildah images --format '{{.Size}}' "$image"))"
