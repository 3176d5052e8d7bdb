#!/usr/bin/env bash
# Trims .device/site-rest.tar.xz (from ../shared/device/make-payload) by what nothing runs on the GPU machine:
# TVM-FFI's C sources, libbacktrace, Cython sources and CMake files (its headers stay: TVM-FFI
# builds its torch DLPack addon with them): about 0.9 MiB, the room the project tree needs beside the payload
# under the device's 64 MiB upload. Idempotent; run once after make-payload.
set -euo pipefail
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
xz -dc .device/site-rest.tar.xz | tar x -C "$tmp"
rm -rf "$tmp/tvm_ffi/3rdparty/libbacktrace" "$tmp/tvm_ffi/src" \
  "$tmp/tvm_ffi/cython" "$tmp/tvm_ffi/share"
(cd "$tmp" && tar c --sort=name . | xz -T2 -9e) > .device/site-rest.tar.xz.new
chmod u+w .device
mv .device/site-rest.tar.xz.new .device/site-rest.tar.xz
du -sb .device
