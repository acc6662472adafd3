#!/usr/bin/env python3
"""`usbwire client` as a service in a vhci-hcd guest (issue 6): an attach rule
gets the host's disk attached at boot; after the host's server restarts it is
attached again by itself and usable (a file written then is in the image);
SIGHUP with the rule removed detaches it; SIGTERM ends the service.

Run: python3 tests/interop/test_service.py   (USBWIRE_BIN=path/to/usbwire)
"""

import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import guest  # noqa: E402

BIN = guest.BIN

SCRIPT = r"""
set -u
mkdir -p /etc/usbwire
cat > /etc/usbwire/client.toml <<EOF
[[attach]]
server = "10.0.2.2:__PORT__"
device = "1209:0003"
also = ["1209:0004"]
EOF
usbwire client -v --config /etc/usbwire/client.toml > /tmp/client.log 2>&1 &
CLIENT=$!
wait_for '[ -e /sys/block/sda ]' 600; check attached-at-boot $?
echo "@@PORT $(usbwire port --json)"
echo "@@READY-FOR-RESTART"
wait_for '[ ! -e /sys/block/sda ]' 600; check detached-when-server-stopped $?
wait_for '[ -e /sys/block/sda ]' 600; check attached-again-after-restart $?
sleep 1
mke2fs -q /dev/sda && mount -t ext2 /dev/sda /mnt && echo after-restart > /mnt/f.txt && sync && umount /mnt
check usable-after-reattach $?
echo "@@READY-FOR-MODE-CHANGE"
wait_for '[ ! -e /sys/block/sda ]' 600; check disk-gone-for-mode-change $?
wait_for '[ -e /dev/ttyACM0 ]' 600; check follows-the-other-identity $?
cat > /etc/usbwire/client.toml <<EOF
[[attach]]
server = "10.0.2.2:__PORT__"
device = "1209:0001"
EOF
kill -HUP $CLIENT
wait_for '[ ! -e /dev/ttyACM0 ]' 300; check sighup-detaches-removed-rule $?
wait_for 'grep -q "usbwire keyboard" /proc/bus/input/devices' 300; check sighup-starts-new-rule $?
kill -TERM $CLIENT; wait $CLIENT; check sigterm-exits-cleanly $?
n=$(usbwire port --json | grep -o '"port"' | wc -l); [ "$n" = 0 ]; check sigterm-detaches $? "$n ports left"
echo "@@CLIENT-LOG-BEGIN"; cat /tmp/client.log; echo "@@CLIENT-LOG-END"
exit 0
"""


# How long the server stays stopped before it restarts.
OUTAGE_S = 13.0


def start_server(port, work, log, *devices):
    specs = [arg for device in devices for arg in ("--virtual", device)]
    return subprocess.Popen([BIN, "serve", "-v", "--listen", f"127.0.0.1:{port}", "--control", os.path.join(work, "c.sock"),
                             *specs], stdout=log, stderr=subprocess.STDOUT)


def restart(server, port, work, log, *devices):
    server.send_signal(signal.SIGTERM)
    server.wait(20)
    return start_server(port, work, log, *devices)


def main():
    guest.require(BIN)
    guest.build()
    checks = guest.Checks()
    work = guest.scratch("usbwire-service-")
    image = os.path.join(work, "disk.img")
    port = guest.free_port()
    log = open(os.path.join(guest.LOGS, "service.server.log"), "w")
    disk = f"disk={image},size=32M,speed=super"
    server = start_server(port, work, log, "keyboard", disk)
    g = None
    try:
        g = guest.Guest("service", SCRIPT.replace("__PORT__", str(port)), files={BIN: "/usr/bin/usbwire"}, timeout=400)
        line = g.wait_for("@@CHECK attached-at-boot ", 200)
        checks.check("the attach rule attaches the disk at boot", " PASS" in line, line)
        line = g.wait_for("@@PORT", 30)
        checks.check("usbwire port shows it with its remote", f'"remote_port":"{port}"' in line and '"remote_busid":"0-2"' in line, line)
        g.wait_for("@@READY-FOR-RESTART", 30)
        server.send_signal(signal.SIGTERM)
        server.wait(20)
        stopped = time.time()
        line = g.wait_for("@@CHECK detached-when-server-stopped ", 90)
        checks.check("the disk goes away when the server stops", " PASS" in line, line)
        # Down long enough for the service to retry several times (its backoff
        # reaches 4 s): each failure reason is logged once, not at every retry.
        time.sleep(max(0.0, OUTAGE_S - (time.time() - stopped)))
        server = start_server(port, work, log, "keyboard", disk)
        checks.back_within(g, "attached-again-after-restart", "attached again by itself after the server restarts", 10, 90)
        line = g.wait_for("@@CHECK usable-after-reattach ", 120)
        checks.check("service: usable-after-reattach", " PASS" in line, line)
        # The device "re-enumerates" under its other identity (as into a bootloader):
        # the server comes back with a CDC-ACM device (1209:0004) instead of the disk.
        g.wait_for("@@READY-FOR-MODE-CHANGE", 60)
        server = restart(server, port, work, log, "keyboard", "serial")
        for name in ["disk-gone-for-mode-change", "follows-the-other-identity", "sighup-detaches-removed-rule", "sighup-starts-new-rule",
                     "sigterm-exits-cleanly", "sigterm-detaches"]:
            line = g.wait_for(f"@@CHECK {name} ", 120)
            checks.check(f"service: {name}", " PASS" in line, line)
        text = g.collect("@@CLIENT-LOG-BEGIN", "@@CLIENT-LOG-END", 30)
        checks.check("the service logs each step", "attached" in text and "attachment lost" in text and "reloading rules" in text,
                     text[-1500:])
        failures = [line for line in text.splitlines() if "attach failed" in line]
        checks.check(f"a {OUTAGE_S:.0f} s outage is logged once per reason, not at every retry", len(failures) <= 2,
                     "\n".join(failures))
        checks.check("guest script exit code", g.finish(60) == 0)
        server.send_signal(signal.SIGTERM)
        server.wait(20)
        out = subprocess.run(["debugfs", "-R", "cat /f.txt", image], capture_output=True, text=True)
        checks.check("the file written after the reattach is in the image", out.stdout.strip() == "after-restart",
                     out.stdout + out.stderr)
    except Exception as error:
        checks.check("service test ran to the end", False, error)
    finally:
        if g:
            g.kill()
        if server.poll() is None:
            server.kill()
        log.close()
    checks.exit()


if __name__ == "__main__":
    main()
