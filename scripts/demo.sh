#!/usr/bin/env bash
# Builds usbwire and runs its demo: a keyboard, a 64 MiB disk and a serial
# port served on 127.0.0.1:3240, listed back through the USB/IP client.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo >/dev/null || { echo "cargo not found: install Rust with rustup (https://rustup.rs)"; exit 1; }
. scripts/build-deps.sh
exec target/release/usbwire demo "$@"
