#!/usr/bin/env bash
# Headless Chromium for the docs check (.ci/docs_check.py), from Debian's packages, with the
# DejaVu fonts the check measures code widths in. Debian, root, idempotent.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
PACKAGES=(chromium fonts-dejavu-core)

installed() {
    local p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || return 1
    done
}

if installed; then
    echo "install-chromium: already installed"
else
    if [ "$(id -u)" != 0 ]; then
        echo "install-chromium: needs root (apt-get); not installed" >&2
        exit 1
    fi
    if ! grep -qsE '^(ID=debian|ID_LIKE=.*debian)' /etc/os-release; then
        echo "install-chromium: only Debian (and its derivatives) is supported; not installed" >&2
        exit 1
    fi
    t0=$SECONDS
    apt-get update -q -q
    apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >/dev/null
    echo "install-chromium: installed in $((SECONDS - t0)) s"
fi
dpkg-query -W -f='${Package} ${Version}\n' "${PACKAGES[@]}"
