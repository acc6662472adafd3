#!/usr/bin/env python3
"""Kernel attach with security: a vhci-hcd guest runs `usbwire attach --tls`;
the kernel gets a local socket and our relay carries the stream over TLS 1.3
(mutual authentication, pinned server key) to `usbwire serve --tls` on the
host. The guest writes a filesystem through it; the stock `usbip` client's
plain attempt is refused.

Run: python3 tests/interop/test_secure.py   (USBWIRE_BIN=path/to/usbwire)
"""

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import guest  # noqa: E402

BIN = guest.BIN

SCRIPT = r"""
set -u
usbip --tcp-port __PORT__ list -r 10.0.2.2 > /tmp/plain.out 2>&1
[ $? != 0 ] && ! grep -q " 0-1: " /tmp/plain.out; check plain-usbip-refused $? "$(cat /tmp/plain.out)"
usbwire attach --tls --compress zstd --identity /etc/usbwire -r 10.0.2.2:__PORT__ -b 0-1 > /tmp/relay.out 2>&1
check attach-returns $? "$(cat /tmp/relay.out)"
wait_path /sys/block/sda; check tls-disk-appears $? "$(cat /tmp/relay.out)"
# attach returned; the relay runs on in the background, and `usbwire port` names it.
RELAY=$(usbwire port --json | sed -n 's/.*"relay":{[^}]*"pid":\([0-9]*\).*/\1/p' | head -n1)
[ -n "$RELAY" ] && kill -0 "$RELAY"; check relay-runs-in-background $? "$(usbwire port --json)"
sleep 1
mke2fs -q /dev/sda && mount -t ext2 /dev/sda /mnt && echo through-the-tls-relay > /mnt/secret.txt && sync && [ "$(cat /mnt/secret.txt)" = through-the-tls-relay ] && umount /mnt
check tls-disk-used $?
P=$(usbwire port --json | sed -n 's/.*"port":\([0-9]*\).*/\1/p' | head -n1)
usbwire detach -p "$P"; check detach $?
i=0; while kill -0 $RELAY 2>/dev/null && [ $i -lt 50 ]; do sleep 0.2; i=$((i+1)); done
! kill -0 $RELAY 2>/dev/null; check relay-ends-with-detach $?
echo "@@RELAY-OUT $(tr '\n' ' ' < /tmp/relay.out)"
exit 0
"""


def main():
    failed = []

    def check(name, ok, detail=""):
        print(f"{'PASS' if ok else 'FAIL'} {name}{(': ' + str(detail)) if detail and not ok else ''}", flush=True)
        if not ok:
            failed.append(name)

    guest.build()
    work = guest.scratch("usbwire-secure-")
    server_dir, client_dir = os.path.join(work, "server"), os.path.join(work, "client")
    fingerprint = {}
    for name, d in [("server", server_dir), ("client", client_dir)]:
        out = subprocess.run([BIN, "identity", "--create", "--json", "--dir", d], capture_output=True, text=True, check=True)
        fingerprint[name] = json.loads(out.stdout)["fingerprint"]
    port = guest.free_port()
    # The guest reaches us as 10.0.2.2: pin our key under that name, as a first
    # `--trust-new` would have.
    with open(os.path.join(client_dir, "known_servers"), "w") as f:
        f.write(f"10.0.2.2:{port} {fingerprint['server']}\n")
    image = os.path.join(work, "disk.img")
    log = open(os.path.join(guest.LOGS, "secure.server.log"), "w")
    server = subprocess.Popen([BIN, "serve", "-v", "--listen", f"127.0.0.1:{port}", "--control", os.path.join(work, "c.sock"),
                               "--tls", "--identity", server_dir, "--allow", fingerprint["client"], "--allow-plain", "never",
                               "--virtual", f"disk={image},size=32M,speed=super"], stdout=log, stderr=subprocess.STDOUT)
    files = {BIN: "/usr/bin/usbwire"}
    for name in ["identity.crt", "identity.key", "known_servers"]:
        files[os.path.join(client_dir, name)] = f"/etc/usbwire/{name}"
    g = guest.Guest("secure", SCRIPT.replace("__PORT__", str(port)), files=files, timeout=300)
    try:
        for name in ["plain-usbip-refused", "attach-returns", "tls-disk-appears", "relay-runs-in-background", "tls-disk-used", "detach", "relay-ends-with-detach"]:
            line = g.wait_for(f"@@CHECK {name} ", 150)
            check(f"guest: {name}", " PASS" in line, line)
        line = g.wait_for("@@RELAY-OUT", 30)
        check("relay said it attached over TLS with zstd", "over TLS with zstd" in line, line)
        check("guest script exit code", g.finish(60) == 0)
        out = subprocess.run(["debugfs", "-R", "cat /secret.txt", image], capture_output=True, text=True)
        check("file written through the TLS relay is in the image", out.stdout.strip() == "through-the-tls-relay", out.stdout + out.stderr)
        log.flush()
        server_log = open(os.path.join(guest.LOGS, "secure.server.log")).read()
        check("server authenticated the client by fingerprint", fingerprint["client"] in server_log, "")
        check("server refused the plain attempt", "plain USB/IP refused" in server_log, "")
    except Exception as error:
        check("secure test ran to the end", False, error)
    finally:
        g.kill()
        server.terminate()
        server.wait(10)
        log.close()
    if failed:
        print(f"\n{len(failed)} check(s) failed: {', '.join(failed)}; logs in {guest.LOGS}")
        sys.exit(1)
    print("all checks passed")


if __name__ == "__main__":
    main()
