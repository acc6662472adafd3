#!/usr/bin/env python3
"""Flashing a board through the network: Debian's dfu-util in a vhci-hcd guest
against the virtual DFU device of `usbwire serve --virtual dfu=FILE` on the host,
through `usbwire attach --follow`.

The guest (udevd running, so libusb sees devices come and go):
1. `usbwire attach --follow -r HOST -b 0-1`, then `dfu-util -l` lists the runtime
   device (1209:0006);
2. `dfu-util -a 0 -D fw.bin`, a random 1 MiB image, in one run: DFU_DETACH makes the
   device re-enumerate as its bootloader (1209:0007), the attachment follows it,
   dfu-util finds it after its detach delay and downloads; manifestation makes it
   re-enumerate into runtime mode, followed again;
3. the runtime device's product string carries the image's SHA-256 prefix;
4. `dfu-util -a 0 -U back.bin` (a third re-enumeration) returns the same bytes;
5. `usbwire port` shows the followed bus id and three re-attachments.
The host checks FILE's SHA-256, and times each re-enumeration from the server's log
line "exported again" to the guest seeing the new device in sysfs (a watcher prints
every change of the USB device list to the console, which the host timestamps).

Run: python3 tests/interop/test_dfu.py   (USBWIRE_BIN=path/to/usbwire)
"""

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import guest  # noqa: E402

BIN = guest.BIN
RUNTIME, BOOTLOADER = "1209:0006", "1209:0007"
# What the guest may take from the server's export to its new device in sysfs: the
# follower attaches within 1 s of the export, then the kernel enumerates the device
# (0.5-0.9 s under TCG, see ../shared/INTEROP-NOTES.md).
REENUMERATION_BOUND = 3.0

# What a DFU guest starts with: helpers, udevd (libusb learns of new devices from its
# events), and a watcher printing every change of the USB device list, which the host
# timestamps to time re-enumerations.
PRELUDE = r"""
set -u
devices() {
  for d in /sys/bus/usb/devices/*; do
    case "$(basename $d)" in usb*|*:*) continue;; esac
    [ -e $d/idProduct ] && printf ' %s=%s:%s' "$(basename $d)" "$(cat $d/idVendor)" "$(cat $d/idProduct)"
  done
}
wait_device() { i=0; while [ $i -lt 300 ]; do devices | grep -q "=$1" && return 0; sleep 0.1; i=$((i+1)); done; return 1; }
/lib/systemd/systemd-udevd --daemon > /tmp/udevd.out 2>&1; check udevd $? "$(cat /tmp/udevd.out)"
# Every change of the USB device list, as it happens (the host times re-enumerations by it).
# A device that goes while it is read makes cat complain: not on the console, where it would
# land inside another step's output.
( last=""; while true; do now="$(devices)"; [ "$now" != "$last" ] && echo "@@DEVICES$now"; last="$now"; sleep 0.02; done ) 2>/dev/null &
WATCH=$!
"""

# dfu-util in the guest: list the runtime device, download /fw.bin through both
# re-enumerations (its exit status as @@DOWNLOAD-RC), read the new product string, upload.
FLASH = r"""
wait_device __RUNTIME__; check runtime-appears $?
dfu-util -l > /tmp/list.out 2>&1
echo "@@LIST-BEGIN"; cat /tmp/list.out; echo "@@LIST-END"
grep -q 'Found Runtime: \[__RUNTIME__\]' /tmp/list.out; check list-runtime $?
dfu-util -a 0 -D /fw.bin > /tmp/download.out 2>&1; rc=$?
echo "@@DOWNLOAD-BEGIN"; cat /tmp/download.out; echo "@@DOWNLOAD-END"
echo "@@DOWNLOAD-RC $rc"
wait_device __RUNTIME__; check runtime-back $?
for d in /sys/bus/usb/devices/*; do
  [ "$(cat $d/idProduct 2>/dev/null)" = "__RUNTIME_PID__" ] && echo "@@PRODUCT $(cat $d/product)"
done
dfu-util -a 0 -U /tmp/back.bin > /tmp/upload.out 2>&1; rc=$?
echo "@@UPLOAD-BEGIN"; cat /tmp/upload.out; echo "@@UPLOAD-END"
check upload $rc
cmp /fw.bin /tmp/back.bin; check upload-same $?
echo "@@BACK $(sha256sum /tmp/back.bin)"
"""

SCRIPT = PRELUDE + r"""
usbwire attach --follow -r 10.0.2.2:__PORT__ -b 0-1 > /tmp/attach.out 2>&1; check attach $? "$(cat /tmp/attach.out)"
cat /tmp/attach.out
""" + FLASH + r"""
echo "@@PORT-JSON $(usbwire port --json)"
usbwire port > /tmp/port.out 2>&1; echo "@@PORT-TEXT $(tr '\n' '|' < /tmp/port.out)"
for p in $(usbwire port --json | tr ',{}' '\n\n\n' | sed -n 's/.*"port":\([0-9]*\).*/\1/p'); do usbwire detach -p $p; done
sleep 1
kill $WATCH
echo "@@DMESG-BEGIN"; dmesg | grep -iE "usb|vhci" | tail -60; echo "@@DMESG-END"
echo "@@RELAY-BEGIN"; tail -40 /var/run/vhci_hcd/usbwire-relay.log 2>/dev/null; echo "@@RELAY-END"
echo "@@DONE"
exit 0
"""


def check_flash(checks, console, first, firmware, digest, download):
    """Checks what FLASH printed (after the guest checks named in `first`) and FILE on the
    host; `download(rc, output)` says whether dfu-util -D succeeded, and why. Returns the
    console's sections by name (`@@NAME-BEGIN` … `@@NAME-END`)."""
    text = "\n".join(line for _, line in console)
    for name in first + ["runtime-appears", "list-runtime", "runtime-back", "upload", "upload-same"]:
        found = [line for _, line in console if f"@@CHECK {name} " in line]
        checks.check(f"guest: {name}", bool(found) and " PASS" in found[0], found[0] if found else "not reached")
    section = lambda name: text.split(f"@@{name}-BEGIN", 1)[-1].split(f"@@{name}-END", 1)[0]
    print("dfu-util -l:" + section("LIST"))
    print("dfu-util -D (tail):\n" + "\n".join(section("DOWNLOAD").strip().splitlines()[-8:]))
    rcs = [int(line.split("@@DOWNLOAD-RC ", 1)[1].split()[0]) for _, line in console if "@@DOWNLOAD-RC " in line]
    ok, said = download(rcs[0] if rcs else None, section("DOWNLOAD"))
    checks.check("guest: download", ok, said)
    print(f"dfu-util -D: {said}")
    checks.check("the download ran through both re-enumerations in one dfu-util run",
                 "Device will detach and reattach" in section("DOWNLOAD") and "Lost device" not in section("DOWNLOAD"),
                 section("DOWNLOAD")[-600:])
    products = [line.split("@@PRODUCT ", 1)[1] for _, line in console if "@@PRODUCT " in line]
    checks.check("the runtime device's product string reports the image's SHA-256",
                 products == [f"usbwire DFU demo (fw {digest[:8]})"], products)
    checks.check("FILE on the host has the image's SHA-256",
                 os.path.exists(firmware) and hashlib.sha256(open(firmware, "rb").read()).hexdigest() == digest)
    backs = [line for _, line in console if "@@BACK " in line]
    checks.check("dfu-util -U returns the same bytes", bool(backs) and digest in backs[0], backs)
    return section


class LogFollower:
    """Follows the server's log as it is written, timestamping each line on arrival."""

    def __init__(self, path):
        self.path = path
        self.lines = []
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        with open(self.path, errors="replace") as f:
            pending = ""
            while not self.stop:
                chunk = f.read()
                if not chunk:
                    time.sleep(0.005)
                    continue
                now = time.time()
                pending += chunk
                *whole, pending = pending.split("\n")
                self.lines.extend((now, line) for line in whole)

    def times_of(self, needle):
        return [at for at, line in self.lines if needle in line]


def main():
    guest.require(BIN)
    guest.build()
    checks = guest.Checks()
    work = guest.scratch("usbwire-dfu-")
    firmware = os.path.join(work, "fw.bin")
    image = os.path.join(work, "image.bin")
    data = os.urandom(1 << 20)
    with open(image, "wb") as f:
        f.write(data)
    digest = hashlib.sha256(data).hexdigest()
    port = guest.free_port()
    log_path = os.path.join(guest.LOGS, "dfu.server.log")
    log = open(log_path, "w")
    server = subprocess.Popen([BIN, "serve", "-v", "--listen", f"127.0.0.1:{port}",
                               "--control", os.path.join(work, "c.sock"), "--virtual", f"dfu={firmware}"],
                              stdout=log, stderr=subprocess.STDOUT)
    follower = LogFollower(log_path)
    script = (SCRIPT.replace("__PORT__", str(port)).replace("__RUNTIME__", RUNTIME)
              .replace("__RUNTIME_PID__", RUNTIME.split(":")[1]))
    g = None
    console = []
    try:
        g = guest.Guest("dfu", script, files={BIN: "/usr/bin/usbwire", image: "/fw.bin"}, timeout=600)
        while True:
            line = g.wait_for("", 400)
            console.append((time.time(), line))
            if "@@DONE" in line:
                break
        section = check_flash(checks, console, ["udevd", "attach"], firmware, digest,
                              lambda rc, _: (rc == 0, f"exit {rc}"))
        port_json = [line.split("@@PORT-JSON ", 1)[1] for _, line in console if "@@PORT-JSON " in line]
        relays = [p.get("relay") or {} for p in json.loads(port_json[0])["ports"]] if port_json else []
        follows = [r.get("follow") for r in relays if r.get("follow")]
        checks.check("usbwire port --json shows the followed bus id and three re-attachments",
                     len(follows) == 1 and follows[0]["busid"] == "0-1" and follows[0]["reattached"] == 3, port_json)
        port_text = [line for _, line in console if "@@PORT-TEXT " in line]
        checks.check("usbwire port says what it follows",
                     bool(port_text) and "following 0-1" in port_text[0] and "3 time(s)" in port_text[0], port_text)
        timings = reenumeration_times(console, follower)
        for what, took in timings:
            print(f"re-enumeration into {what}: guest saw the new device {took * 1000:.0f} ms after the server's export")
        checks.check("three re-enumerations timed", len(timings) == 3, timings)
        checks.check(f"each within {REENUMERATION_BOUND} s of the export",
                     all(0 <= took <= REENUMERATION_BOUND for _, took in timings), timings)
        reattached = re.findall(r"reattach_ms=(\d+)", section("RELAY"))
        print(f"follower: from the server's notice to the new vhci attach: {', '.join(reattached)} ms")
        checks.check("the follower attached again within 1 s of each notice",
                     len(reattached) == 3 and all(int(ms) < 1000 for ms in reattached), reattached)
        debug = [line for _, line in follower.lines if "re-export time since the device switched" in line]
        micros = [re.search(r"reexport_us=(\d+)", line) for line in debug]
        print(f"server: re-exported {', '.join(m.group(1) for m in micros if m)} us after the device switched")
        checks.check("the server re-exported within 100 ms of each switch",
                     len(micros) == 3 and all(m and int(m.group(1)) < 100_000 for m in micros), debug)
        dmesg = section("DMESG")
        checks.check("no vhci errors in dmesg", "already given back" not in dmesg and "error" not in dmesg.lower(),
                     dmesg[-800:])
        checks.check("guest script exit code", g.finish(60) == 0)
    except Exception as error:
        checks.check("dfu test ran to the end", False, error)
    finally:
        follower.stop = True
        if g:
            g.kill()
        server.terminate()
        server.wait(10)
        log.close()
    if checks.failed:
        print(f"server log: {log_path}; console: {os.path.join(guest.LOGS, 'dfu.console.log')}")
    checks.exit()


def reenumeration_times(console, follower):
    """(new VID:PID, seconds from the server's "exported again" line to the guest's device list showing it)."""
    exports = follower.times_of("exported again under the same bus id")
    seen = []
    previous = None
    for at, line in console:
        if not line.startswith("@@DEVICES"):
            continue
        ids = set(re.findall(r"=(\w{4}:\w{4})", line))
        current = next((i for i in (BOOTLOADER, RUNTIME) if i in ids), None)
        if current and previous and current != previous:
            seen.append((current, at))
        if current:
            previous = current
    return [(what, at - exported) for (what, at), exported in zip(seen, exports)]


if __name__ == "__main__":
    main()
