#!/usr/bin/env bash
# Packs GPU binaries built on this machine for a GPU machine that cannot build them (no gRPC,
# absl or GoogleTest there): copies them to OUT/bin and every shared library they need, except
# glibc, the C++ runtime and CUDA's own (the GPU machine has newer ones), to OUT/lib.
# Writes OUT.tgz too: carry that (scripts/gpu/run.sh unpacks it; the folder is over the limit).
#   scripts/gpu/pack.sh OUT BINARY...
set -euo pipefail
out=$1
shift
mkdir -p "$out/bin" "$out/lib"
for bin in "$@"; do
  cp "$bin" "$out/bin/"
  strip --strip-unneeded "$out/bin/$(basename "$bin")"
  ldd "$bin" | awk '$3 ~ /^\// {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so* | libm.so* | libdl.so* | libpthread.so* | librt.so* | libstdc++.so* | libgcc_s.so* | \
        ld-linux* | libcuda.so* | libcudart.so* | libcublas*.so*) ;;
      *) cp -L -n "$lib" "$out/lib/" ;;
    esac
  done
done
du -sh "$out"
tar -czf "$out.tgz" "$out"
ls -la "$out.tgz"
