#!/usr/bin/env bash
# Runs every test usbwire has, from a fresh Debian 12 machine: installs what the
# tests need (Debian packages; crates from crates.io), then lints, unit,
# property and integration tests, a short fuzzing pass, and the interop tests
# against real Linux kernels booted under QEMU. Exits non-zero on the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

step "Debian packages"
packages=(qemu-system-x86 usbip dfu-util busybox-static kmod cpio e2fsprogs python3 gcc g++ libc6-dev hwdata tshark iproute2 usbredirect prometheus man-db systemd chromium protobuf-compiler libprotobuf-dev etcd-server openssl git dpkg-dev python3-pytest python3-venv)
missing=()
for p in "${packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
command -v cargo >/dev/null || { echo "cargo not found: install Rust with rustup (https://rustup.rs)"; exit 1; }

# A run from a clean checkout never reuses incremental state: it only costs disk
# (11 GB of it for the workspace's tests).
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

step "format and lints"
cargo fmt --all --check
python3 scripts/size-lint.py   # no file over 600 lines, no fn over 100, unless marked size-exempt with why
cargo clippy --workspace --all-targets --locked -- -D warnings

step "unit, property and integration tests"
cargo test --workspace --locked

step "release build"
cargo build --release --locked -p usbwire-cli
cargo build --release --locked -p usbwire-client --examples

step "Python device library and Facedancer backend (pytest, against the release binary)"
# Debian's python3, whose site packages hold python3-pytest (a python3 earlier on PATH may not see them).
/usr/bin/python3 -m venv --system-site-packages target/pyenv
target/pyenv/bin/pip install --quiet 'facedancer>=3.1,<4'
target/pyenv/bin/pip install --quiet --force-reinstall --no-deps ./python
USBWIRE_BIN="$PWD/target/release/usbwire" target/pyenv/bin/python -m pytest -q python/tests

if [ -x fuzz/run.sh ]; then
  step "fuzzing (short)"
  FUZZ_SECONDS="${FUZZ_SECONDS:-20}" fuzz/run.sh
fi

step "interop with real Linux kernels (QEMU)"
export USBWIRE_BIN="$PWD/target/release/usbwire"
for test in tests/interop/test_*.py; do
  step "$test"
  python3 "$test"
done

step "all tests passed"
