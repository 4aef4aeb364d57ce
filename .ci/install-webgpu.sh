#!/usr/bin/env bash
# Software Vulkan driver for the ort backend's WebGPU plugin-EP tests: Mesa 25 lavapipe from
# Debian bookworm-backports (stock bookworm Mesa 22 is rejected by Dawn). Debian, root, idempotent.
# Python packages come from the backend's extras: pip install -e "backends/ort[webgpu]".
# Never purge these packages afterwards: with Mesa 25 the GL driver depends on libvulkan1.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive

if [ "$(id -u)" != 0 ]; then
    echo "install-webgpu: needs root (apt-get); skipping" >&2
    exit 1
fi
if ! grep -qs '^VERSION_CODENAME=bookworm' /etc/os-release; then
    echo "install-webgpu: only Debian bookworm is supported; skipping" >&2
    exit 1
fi

installed_from_backports() {
    # mesa-vulkan-drivers 25.x (bookworm-backports) and libvulkan1 present: nothing to do.
    local v
    v=$(dpkg-query -W -f='${Status} ${Version}' mesa-vulkan-drivers 2>/dev/null) || return 1
    case "$v" in "install ok installed 2"[5-9]*) ;; *) return 1 ;; esac
    dpkg-query -W -f='${Status}' libvulkan1 2>/dev/null | grep -q "install ok installed"
}

add_backports() {
    # Same mirror and key as the machine's own Debian entry (deb822 or one-line format).
    grep -rqs bookworm-backports /etc/apt/sources.list /etc/apt/sources.list.d/ && return 0
    local s=/etc/apt/sources.list.d/debian.sources m k=/usr/share/keyrings/debian-archive-keyring.gpg
    if [ -f "$s" ]; then
        m=$(awk '$1=="URIs:" && $2 !~ /security/ {print $2; exit}' "$s")
        k=$(awk '$1=="Signed-By:" {print $2; exit}' "$s")
    else
        m=$(awk '$1=="deb" && !/security/ {for(i=2;i<=NF;i++) if($i ~ /:\/\//){print $i; exit}}' \
            /etc/apt/sources.list)
    fi
    m=${m:-http://deb.debian.org/debian}
    printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: main\nSigned-By: %s\n' \
        "$m" "$k" >/etc/apt/sources.list.d/bookworm-backports.sources
}

if installed_from_backports; then
    echo "install-webgpu: Mesa lavapipe from bookworm-backports already installed"
else
    t0=$SECONDS
    add_backports
    apt-get update -q -q
    apt-get install -y -q --no-install-recommends -t bookworm-backports \
        mesa-vulkan-drivers libvulkan1 >/dev/null
    echo "install-webgpu: installed in $((SECONDS - t0)) s"
fi
dpkg-query -W -f='${Package} ${Version}\n' mesa-vulkan-drivers libvulkan1
echo "install-webgpu: set ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1 to use the software adapter"
