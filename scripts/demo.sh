#!/usr/bin/env bash
# Builds usbwire and runs its demo: a keyboard, a 64 MiB disk and a serial
# port served on 127.0.0.1:3240, listed back through the USB/IP client.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo >/dev/null || { echo "cargo not found: install Rust with rustup (https://rustup.rs)"; exit 1; }
# protoc builds the etcd client (gRPC) the lab registry uses.
if ! command -v protoc >/dev/null; then
  as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends protobuf-compiler
fi
cargo build --release --locked -p usbwire-cli
exec target/release/usbwire demo "$@"
