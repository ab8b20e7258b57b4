#!/usr/bin/env bash
# The kernels on aarch64: cross-compile kiln-kernels for aarch64-unknown-linux-gnu and run its
# tests (the NEON tier against the scalar references, matmul against the naive loop, every
# determinism check) under qemu user-mode emulation. Clippy runs for that target too.
# KILN_EXPECT_TIERS=neon makes the tests fail, rather than quietly test the scalar tier alone,
# if the NEON tier is not detected under emulation.
#
# Installs what it needs: the Rust standard library for the target (rustup), and Debian's
# cross linker and qemu-user (apt-get, as root or through sudo).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

target=aarch64-unknown-linux-gnu
if ! rustup target list --installed | grep -qx "$target"; then
    rustup target add "$target"
fi
if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
    sudo=""
    if [ "$(id -u)" != 0 ]; then sudo=sudo; fi
    $sudo apt-get update -q
    $sudo apt-get install -y -q qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross
fi

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
export CARGO_TARGET_DIR="$root/target/aarch64-cross"

cargo clippy -p kiln-kernels --all-targets --target "$target" -- -D warnings
KILN_EXPECT_TIERS=neon cargo test -p kiln-kernels --release --target "$target"
