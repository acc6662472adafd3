#!/usr/bin/env bash
# Runs every fuzz target briefly; CI calls this (scripts/test.sh). Exits non-zero on the
# first crash, leaving the input in fuzz/artifacts/<target>/.
#
#   FUZZ_SECONDS=20          seconds per target (default 20)
#   FUZZ_TARGETS="a b"       which targets (default: all)
#   FUZZ_MODE=auto           libfuzzer | replay | auto (libfuzzer, or replay if cargo-fuzz
#                            cannot be installed or built)
#
# libFuzzer is C++ (g++, which scripts/test.sh installs) and needs nightly-only rustc
# flags (-Zsanitizer, sancov passes). On a stable toolchain RUSTC_BOOTSTRAP=1 unlocks
# them; see README.md.
set -euo pipefail
cd "$(dirname "$0")"

seconds="${FUZZ_SECONDS:-20}"
targets="${FUZZ_TARGETS:-decode_command decode_return op_phase transform_frames server_session client_session redir_packets redir_host dfu_control redir_bridge external_frames tls_records tls_pair tls_differential storage_accelerator recording lab_catalog}"
mode="${FUZZ_MODE:-auto}"

run_replay() {
  echo "fuzz: replay mode (stable Rust, no coverage feedback), ${seconds}s per target"
  cargo build --release --locked --no-default-features --bin replay
  # shellcheck disable=SC2086 # targets is a word list
  ./target/release/replay --seconds "$seconds" $targets
}

if [ "$mode" = replay ]; then
  run_replay
  exit
fi

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "fuzz: installing cargo-fuzz"
  if ! cargo install cargo-fuzz --locked; then
    [ "$mode" = libfuzzer ] && exit 1
    echo "fuzz: cargo-fuzz could not be installed; falling back to replay mode"
    run_replay
    exit
  fi
fi

case "$(rustc --version)" in
  *nightly*) ;;
  *) export RUSTC_BOOTSTRAP=1 ;; # stable: allow the -Z flags cargo-fuzz passes
esac

if ! cargo fuzz build; then
  [ "$mode" = libfuzzer ] && exit 1
  echo "fuzz: cargo fuzz build failed; falling back to replay mode"
  run_replay
  exit
fi

for target in $targets; do
  echo "fuzz: $target for ${seconds}s"
  mkdir -p "corpus/$target"
  # corpus/ (first) collects what libFuzzer finds and is not committed; seeds/ is read only.
  # -malloc_limit_mb: any allocation above 64 MiB is a failure (no input is that large, so
  # it would be sized from an unchecked length).
  cargo fuzz run "$target" "corpus/$target" "seeds/$target" -- \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=64 -print_final_stats=1
done
echo "fuzz: all targets ran ${seconds}s without a failure"
