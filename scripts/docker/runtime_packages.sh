#!/usr/bin/env bash
# Prints the Debian/Ubuntu packages that hold the shared libraries the given binaries load, one
# per line: what a container's runtime stage installs (the build stage runs this on its binaries,
# so the list follows the build's real dependencies on either distribution).
# Fails, naming the library, when a library is missing or belongs to no package. Libraries of
# the CUDA toolkit (/usr/local/cuda*) are left to the CUDA base image.
set -euo pipefail
if [ "$#" -eq 0 ]; then
  echo "usage: $0 BINARY..." >&2
  exit 2
fi

owner() {
  # dpkg records the path as the package installed it; on merged-/usr systems ldd may report
  # /lib/... for a file dpkg lists as /usr/lib/... (or the reverse), and symlinks may resolve
  # elsewhere: try each spelling.
  local lib="$1" real
  real="$(readlink -f "$lib")"
  for p in "$lib" "$real" "/usr$lib" "${lib#/usr}" "/usr$real" "${real#/usr}"; do
    if out="$(dpkg-query -S "$p" 2>/dev/null)"; then
      echo "${out%%:*}" | cut -d, -f1
      return 0
    fi
  done
  return 1
}

status=0
packages=()
for bin in "$@"; do
  if ! deps="$(ldd "$bin")"; then
    echo "$bin: not a dynamic executable" >&2
    exit 1
  fi
  while read -r name arrow path _; do
    if [ "$arrow" != "=>" ]; then continue; fi
    # The CUDA runtime and cuBLAS come with the nvidia/cuda runtime base image (and a toolkit
    # installed by hand under /usr/local/cuda belongs to no package): not ours to install.
    case "$(readlink -f "$path" 2>/dev/null || echo "$path")" in
      /usr/local/cuda*) continue ;;
    esac
    if [ "$path" = "not" ]; then
      echo "$bin: $name is not found" >&2
      status=1
    elif package="$(owner "$path")"; then
      packages+=("$package")
    else
      echo "$bin: $path belongs to no package" >&2
      status=1
    fi
  done <<<"$deps"
done
if [ "$status" -ne 0 ]; then exit "$status"; fi
printf '%s\n' "${packages[@]}" | sort -u
