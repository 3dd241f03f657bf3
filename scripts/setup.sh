#!/usr/bin/env bash
# Idempotent set-up on a fresh Debian/Ubuntu machine: system packages, a
# virtualenv with pytest-forkd installed, and the default guest image.
# A second run is fast and needs no network.
#
# Works as a normal user: root (through sudo) is asked for only when system
# packages are missing; everything else lives in the checkout and in the
# user's own cache (~/.cache/pytest-forkd) and runtime directory
# (/dev/shm/pytest-forkd-<uid>).
set -euo pipefail
cd "$(dirname "$0")/.."

# --system-only: install the missing system packages and stop (for an administrator
# preparing a host where normal users then run `make example` / `make test`).
SYSTEM_ONLY=0
if [ "${1:-}" = --system-only ]; then SYSTEM_ONLY=1; fi
# --test-tools: what only the test suite needs (`make test` runs it): a registry server, image tools and
# builders for the container image tests, and podman's configuration for this host (as root). Without
# root or sudo it says what is missing and goes on: those tests skip, naming what they need.
TEST_TOOLS=0
if [ "${1:-}" = --test-tools ]; then TEST_TOOLS=1; fi

VENV=${FORKD_VENV:-.venv}
PYTHON=${PYTHON:-python3}
IS_ROOT=0
if [ "$(id -u)" = 0 ]; then IS_ROOT=1; fi

# Run an apt command as root: directly, through sudo, or fail saying what to run.
as_root() {
  if [ "$IS_ROOT" = 1 ]; then "$@"; return; fi
  # sudo without a password, or with a terminal to ask for one
  if command -v sudo >/dev/null && { sudo -n true 2>/dev/null || [ -t 0 ]; }; then
    sudo "$@"; return
  fi
  echo "setup: needs root for: $*" >&2
  echo "setup: run that as root (or give $(id -un) sudo), then run this again" >&2
  exit 1
}

if [ "$TEST_TOOLS" = 1 ]; then
  test_pkgs=()
  for tool in skopeo:skopeo docker-registry:docker-registry umoci:umoci podman:podman buildah:buildah \
              runc:runc zstd:zstd; do
    command -v "${tool%%:*}" >/dev/null || test_pkgs+=("${tool#*:}")
  done
  if [ ${#test_pkgs[@]} -gt 0 ]; then
    if [ "$IS_ROOT" = 1 ] || { command -v sudo >/dev/null && sudo -n true 2>/dev/null; }; then
      echo "setup: installing the test tools ${test_pkgs[*]}" >&2
      as_root apt-get update -qq
      as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${test_pkgs[@]}" >/dev/null
    else
      echo "setup: the container image tests need ${test_pkgs[*]} (apt-get install them as root); they skip meanwhile" >&2
    fi
  fi
  # podman builds here need runc and cgroupfs (crun refuses the hybrid cgroup layout), and plain HTTP to the
  # tests' registries on 127.0.0.1. Written only as root, and never over an administrator's own file.
  if [ "$IS_ROOT" = 1 ] && command -v podman >/dev/null; then
    mkdir -p /etc/containers/registries.conf.d
    # lock_type file: podman's locks stay in its runtime folder; the default (shm) leaves a lock file in
    # /dev/shm for root and one per user that outlives every run. An earlier set-up's file is rewritten.
    conf=/etc/containers/containers.conf
    if [ ! -f "$conf" ] || [ "$(cat "$conf")" = "$(printf '[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"')" ]; then
      printf '# pytest-forkd scripts/setup.sh: podman builds for the container image tests\n[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\nlock_type = "file"\n' \
        > "$conf"
      echo "setup: wrote $conf (runc, cgroupfs, file locks) for podman builds" >&2
    fi
    if [ ! -f /etc/containers/registries.conf.d/50-forkd-tests.conf ]; then
      printf '[[registry]]\nlocation = "127.0.0.1"\ninsecure = true\n\n[[registry]]\nlocation = "localhost"\ninsecure = true\n' \
        > /etc/containers/registries.conf.d/50-forkd-tests.conf
      echo "setup: wrote /etc/containers/registries.conf.d/50-forkd-tests.conf (plain HTTP to 127.0.0.1)" >&2
    fi
  fi
  exit 0
fi

# What `make example` and a first test need; README.md's install line names the same packages.
need_pkgs=()
command -v qemu-system-x86_64 >/dev/null || need_pkgs+=(qemu-system-x86)
command -v git >/dev/null || need_pkgs+=(git)
"$PYTHON" -c 'import venv, ensurepip' 2>/dev/null || need_pkgs+=(python3-venv)
# The guest image builder reads a pinned Debian release from a mirror itself
# (no apt lists needed) and checks its signature with gpgv (or sqv, apt's own
# verifier on Debian 13) and Debian's keyring.
command -v gpgv >/dev/null || command -v sqv >/dev/null || need_pkgs+=(gpgv)
[ -f /usr/share/keyrings/debian-archive-keyring.gpg ] || [ -n "${FORKD_DEBIAN_KEYRING:-}" ] \
  || need_pkgs+=(debian-archive-keyring)
# Container images (docker://, oci:... references) alone need skopeo, which pulls them, and e2fsprogs, whose
# mke2fs and debugfs write their read-only disk (no root needed then). Installed along when that needs no
# password (root, or sudo without one); otherwise named once, and everything else goes on without them.
image_pkgs=()
command -v skopeo >/dev/null || image_pkgs+=(skopeo)
{ command -v mke2fs && command -v debugfs; } >/dev/null 2>&1 || [ -x /sbin/mke2fs ] || image_pkgs+=(e2fsprogs)
if [ ${#image_pkgs[@]} -gt 0 ]; then
  if [ "$IS_ROOT" = 1 ] || { command -v sudo >/dev/null && sudo -n true 2>/dev/null; }; then
    need_pkgs+=("${image_pkgs[@]}")
  else
    echo "setup: container images (docker://, oci:...) need ${image_pkgs[*]}, which only root can install" \
      "(sudo apt-get install ${image_pkgs[*]}); the default image, make example and make test do without" >&2
  fi
fi
if [ ${#need_pkgs[@]} -gt 0 ]; then
  echo "setup: apt-get update" >&2
  as_root apt-get update -qq
  echo "setup: installing ${need_pkgs[*]}" >&2
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
fi

if [ "$SYSTEM_ONLY" = 1 ]; then echo "setup: system packages are installed" >&2; exit 0; fi

# A virtualenv whose creation was interrupted has python but no pip: make it again.
if [ ! -x "$VENV/bin/python" ] || [ ! -x "$VENV/bin/pip" ]; then
  echo "setup: creating $VENV" >&2
  "$PYTHON" -m venv --clear "$VENV"
fi
stamp="$VENV/.forkd-installed"
want=$(cat pyproject.toml | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing pytest-forkd into $VENV" >&2
  "$VENV/bin/pip" install -q --disable-pip-version-check -e '.[dev,inspect,openai-agents,mini-swe-agent,e2b]'
  echo "$want" > "$stamp"
fi

"$VENV/bin/forkd" image build
