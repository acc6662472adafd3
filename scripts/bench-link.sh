#!/usr/bin/env bash
# TLS 1.3 (or compression) against plain USB/IP over the same path: on unshaped loopback,
# and on links shaped to each RATE (a token-bucket filter on the loopback of a network
# namespace of our own, so nothing outside it is touched). Shows what TLS or compression
# costs where the link, not the CPU, is the limit. Needs root and iproute2 (tc); runs the
# release binary.
#
#   scripts/bench-link.sh [RATE...]                  TLS; default rates: unshaped 10gbit 1gbit
#   scripts/bench-link.sh --compress zstd [RATE...]  zstd on incompressible data (the noise
#                                                    source 0x85 and random OUT payloads);
#                                                    DATA=compressible: the loopback source
#                                                    and sink's own pattern instead
#   USBWIRE_BIN=path SECONDS_PER_POINT=0.5 REPEAT=3 scripts/bench-link.sh
#
# Prints one line per direction and URB size: plain and variant MiB/s, variant/plain,
# and each one's ratio to the raw-TCP ceiling of the same (shaped) path.
set -euo pipefail
cd "$(dirname "$0")/.."

bin="${USBWIRE_BIN:-$PWD/target/release/usbwire}"
seconds="${SECONDS_PER_POINT:-0.5}"
repeat="${REPEAT:-3}"
work="$(mktemp -d)"
variant=(--tls --trust-new --identity "$work/client")
data=()
name=TLS
if [ "${1:-}" = --compress ]; then
  [ -n "${2:-}" ] || { echo "bench-link: --compress needs zstd or lz4" >&2; exit 64; }
  variant=(--compress "$2")
  [ "${DATA:-random}" = compressible ] || data=(--in-ep 0x85 --payload random)
  name="$2"
  shift 2
fi
rates=("$@")
[ ${#rates[@]} -eq 0 ] && rates=(unshaped 10gbit 1gbit)
[ -x "$bin" ] || { echo "bench-link: no binary at $bin (cargo build --release first)" >&2; rm -rf "$work"; exit 66; }
[ "$(id -u)" = 0 ] || { echo "bench-link: needs root for ip netns and tc" >&2; rm -rf "$work"; exit 77; }

ns="usbwire-link-$$"
server=""
cleanup() {
  [ -n "$server" ] && kill "$server" 2>/dev/null && wait "$server" 2>/dev/null
  ip netns del "$ns" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

"$bin" identity --dir "$work/server" --create -q >/dev/null
fingerprint="$("$bin" identity --dir "$work/client" --create --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["fingerprint"])')"

printf '%-9s %-4s %9s %12s %12s %11s %10s %10s\n' link dir urb_size "plain MiB/s" "$name MiB/s" "$name/plain" "plain/raw" "$name/raw"
for rate in "${rates[@]}"; do
  ip netns add "$ns"
  ip -n "$ns" link set lo up
  if [ "$rate" != unshaped ]; then
    # burst: at least one timer tick's worth at the rate, and more than lo's 64 KiB MTU.
    ip netns exec "$ns" tc qdisc add dev lo root tbf rate "$rate" burst 8mb latency 50ms
  fi
  ip netns exec "$ns" "$bin" serve --listen 127.0.0.1:3240 --tls --identity "$work/server" \
    --allow "$fingerprint" --allow-plain always --virtual loopback --control "$work/control" -q >/dev/null &
  server=$!
  for _ in $(seq 50); do ip netns exec "$ns" "$bin" list -r 127.0.0.1 -q >/dev/null 2>&1 && break; sleep 0.1; done
  bench() {
    ip netns exec "$ns" "$bin" bench -r 127.0.0.1 -b 0-1 --sizes 64K,1M --depths 8 \
      --seconds "$seconds" --repeat "$repeat" --json -q ${data[@]+"${data[@]}"} "$@"
  }
  bench > "$work/plain.json"
  bench "${variant[@]}" > "$work/variant.json"
  python3 - "$rate" "$work/plain.json" "$work/variant.json" <<'EOF'
import json, sys
rate, plain, variant = sys.argv[1], *(json.load(open(p))["records"] for p in sys.argv[2:])
key = lambda r: (r["direction"], r["urb_size"])
variant = {key(r): r for r in variant}
for p in plain:
    v = variant[key(p)]
    print(f'{rate:<9} {p["direction"]:<4} {p["urb_size"]:>9} {p["mib_per_s"]:>12.1f} {v["mib_per_s"]:>12.1f} '
          f'{v["mib_per_s"] / p["mib_per_s"]:>11.2f} {p["ratio_to_raw_tcp"]:>10.2f} {v["ratio_to_raw_tcp"]:>10.2f}')
EOF
  kill "$server"; wait "$server" 2>/dev/null || true
  server=""
  ip netns del "$ns"
done
