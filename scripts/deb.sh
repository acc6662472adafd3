#!/usr/bin/env bash
# Builds the Debian package with cargo-deb: target/debian/usbwire_VERSION-1_ARCH.deb,
# with the binary, the man pages and shell completions it writes itself, and
# contrib/'s systemd units and sysusers.d file (no udev rule: `usbwire udev-rules`
# prints them for the configured devices). Prints the path.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo >/dev/null || { echo "cargo not found: install Rust with rustup (https://rustup.rs)"; exit 1; }
# dpkg-shlibdeps (dpkg-dev) gives cargo-deb the package's library dependencies.
extra_build_packages=(dpkg-dev)
. scripts/build-deps.sh
command -v cargo-deb >/dev/null || cargo install cargo-deb --locked
assets=target/release/deb-assets
rm -rf "$assets"
mkdir -p "$assets/man" "$assets/completions" "$assets/systemd"
# The units in contrib/ name the `cargo install` path; the package installs into /usr/bin.
for unit in contrib/systemd/*.service; do
  sed 's|/usr/local/bin/usbwire|/usr/bin/usbwire|g' "$unit" > "$assets/systemd/$(basename "$unit")"
done
target/release/usbwire man --dir "$assets/man" >/dev/null
gzip -9n "$assets"/man/*.1 "$assets"/man/*.5
target/release/usbwire completions bash > "$assets/completions/usbwire"
target/release/usbwire completions zsh > "$assets/completions/_usbwire"
target/release/usbwire completions fish > "$assets/completions/usbwire.fish"
cargo deb -p usbwire-cli --no-build --locked --no-strip
