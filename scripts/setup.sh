#!/usr/bin/env bash
# Idempotent set-up on a fresh Debian/Ubuntu machine: system packages, a
# virtualenv with pytest-forkd installed, and the default guest image.
# A second run is fast and needs no network.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${FORKD_VENV:-.venv}
PYTHON=${PYTHON:-python3}
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

need_pkgs=()
command -v qemu-system-x86_64 >/dev/null || need_pkgs+=(qemu-system-x86)
command -v dpkg-deb >/dev/null || need_pkgs+=(dpkg)
command -v git >/dev/null || need_pkgs+=(git)
"$PYTHON" -c 'import venv, ensurepip' 2>/dev/null || need_pkgs+=(python3-venv)
# The guest image is assembled from Debian packages: apt needs current package
# lists (stale ones name versions the mirror no longer has). Refresh them on a
# first set-up, when packages are missing, or when they are older than a week;
# otherwise set-up stays offline.
apt_stamp="$VENV/.forkd-apt-updated"
if [ ${#need_pkgs[@]} -gt 0 ] || ! apt-cache show busybox-static >/dev/null 2>&1 \
   || [ -z "$(find "$apt_stamp" -mtime -7 2>/dev/null)" ]; then
  echo "setup: apt-get update" >&2
  $SUDO apt-get update -qq
  mkdir -p "$VENV" && touch "$apt_stamp"
fi
if [ ${#need_pkgs[@]} -gt 0 ]; then
  echo "setup: installing ${need_pkgs[*]}" >&2
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV" >&2
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.forkd-installed"
want=$(cat pyproject.toml | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing pytest-forkd into $VENV" >&2
  "$VENV/bin/pip" install -q --disable-pip-version-check -e '.[dev]'
  echo "$want" > "$stamp"
fi

"$VENV/bin/forkd" image build
