#!/usr/bin/env bash
# Installs the given Debian/Ubuntu packages that are not installed yet (apt, with sudo when not
# root); installs nothing, and needs no network, when all are there. Used by scripts/setup.sh
# and by the images' build stage (scripts/docker/build.sh).
# Usage: scripts/install_packages.sh PACKAGE...
set -euo pipefail
missing=()
for p in "$@"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if ((${#missing[@]})); then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  echo "install_packages: installing ${missing[*]}" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >&2
fi
