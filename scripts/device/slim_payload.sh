#!/usr/bin/env bash
# Trims .device/site-rest.tar.xz (from ../shared/device/make-payload) by TVM-FFI's C sources and libbacktrace,
# which nothing runs on the GPU machine: about 0.6 MiB, the room the project tree needs beside the payload under
# the device's 64 MiB upload. Idempotent; run once after make-payload.
set -euo pipefail
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
xz -dc .device/site-rest.tar.xz | tar x -C "$tmp"
rm -rf "$tmp/tvm_ffi/3rdparty/libbacktrace" "$tmp/tvm_ffi/src"
(cd "$tmp" && tar c --sort=name . | xz -T2 -9e) > .device/site-rest.tar.xz.new
chmod u+w .device
mv .device/site-rest.tar.xz.new .device/site-rest.tar.xz
du -sb .device
