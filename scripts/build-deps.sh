# Sourced by demo.sh and deb.sh: installs what building usbwire needs beyond
# Rust (a C compiler and linker; protoc and the well-known .proto files that
# the etcd client's gRPC build reads; git, for `usbwire -V` to name the commit;
# and what the caller adds in extra_build_packages), then builds the release binary.
# Not for running tests: test.sh installs its own, larger list.
build_packages=(gcc libc6-dev protobuf-compiler libprotobuf-dev git ${extra_build_packages[@]+"${extra_build_packages[@]}"})
build_missing=()
for p in "${build_packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || build_missing+=("$p"); done
if [ ${#build_missing[@]} -gt 0 ]; then
  echo "installing what the build needs: ${build_missing[*]}"
  if [ "$(id -u)" = 0 ]; then sudo_=(); elif command -v sudo >/dev/null; then sudo_=(sudo); else
    echo "usbwire's build needs these Debian packages: ${build_missing[*]}; install them as root (apt-get install ${build_missing[*]}) and run this again"; exit 1
  fi
  "${sudo_[@]}" apt-get update -qq
  "${sudo_[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${build_missing[@]}"
fi
command -v cc >/dev/null || { echo "no C compiler and linker (cc) after installing gcc: install gcc and libc6-dev, then run this again"; exit 1; }
cargo build --release --locked -p usbwire-cli
