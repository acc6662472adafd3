#!/usr/bin/env python3
"""Flashing a board through a usbredir bridge: Debian's dfu-util in a QEMU guest whose
usb-redir device is connected to `usbwire redir -b 0-1 --listen unix:PATH`, which imports
the virtual DFU device of `usbwire serve --virtual dfu=FILE` on the host. The guest has no
usbip: its own xHCI controller sees the board, and sees it unplugged and plugged in again
when it re-enumerates on its own (the bridge follows it: device_disconnect, the bus id
imported again, device_connect with the new descriptors). After manifestation dfu-util
resets the board, which re-enumerates on that reset: the bridge does not unplug it, the
guest kernel's descriptor reads after its reset are answered by the new device, and the
kernel re-enumerates the port itself ("device firmware changed"), as for a board attached
to the guest directly.

The guest (udevd running, so libusb sees devices come and go):
1. `dfu-util -l` lists the runtime device (1209:0006);
2. `dfu-util -a 0 -D fw.bin`, a random 1 MiB image, in one run: DFU_DETACH makes the
   device re-enumerate as its bootloader (1209:0007), the bridge follows it, dfu-util
   finds it and downloads; dfu-util's reset after manifestation makes it re-enumerate
   into runtime mode, followed again;
3. the runtime device's product string carries the image's SHA-256 prefix;
4. `dfu-util -a 0 -U back.bin` (into the bootloader once more) returns the same bytes.
The host checks FILE's SHA-256, that the bridge kept one guest connection throughout, and
times each re-enumeration as the guest sees it: from the server's log line "exported again"
to the guest's device list showing the new device, and from the old device leaving the
guest's list to the new one arriving (a watcher prints every change of the list to the
console, which the host timestamps).

Run: python3 tests/interop/test_dfu_redir.py   (USBWIRE_BIN=path/to/usbwire)
"""

import hashlib
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import guest  # noqa: E402
from test_dfu import BOOTLOADER, FLASH, PRELUDE, RUNTIME, LogFollower, check_flash  # noqa: E402

BIN = guest.BIN
# What the guest may take from the server's export to its new device in its device list:
# the bridge imports again at once and announces the device; QEMU waits 200 ms (virtual
# time) after an unplug before it plugs a device in, then the guest's kernel enumerates it
# on its xHCI controller (under TCG).
REENUMERATION_BOUND = 5.0

SCRIPT = PRELUDE + FLASH + r"""
sleep 2
kill $WATCH
echo "@@DMESG-BEGIN"; dmesg | grep -iE "usb|xhci" | tail -60; echo "@@DMESG-END"
echo "@@DONE"
exit 0
"""


def main():
    guest.require(BIN, "/usr/bin/qemu-system-x86_64")
    guest.build()
    checks = guest.Checks()
    work = guest.scratch("usbwire-dfu-redir-")
    os.chmod(work, 0o700)
    firmware = os.path.join(work, "fw.bin")
    image = os.path.join(work, "image.bin")
    socket_path = os.path.join(work, "redir.sock")
    data = os.urandom(1 << 20)
    with open(image, "wb") as f:
        f.write(data)
    digest = hashlib.sha256(data).hexdigest()
    port = guest.free_port()
    server_log_path = os.path.join(guest.LOGS, "dfu-redir.server.log")
    bridge_log_path = os.path.join(guest.LOGS, "dfu-redir.bridge.log")
    server_log, bridge_log = open(server_log_path, "w"), open(bridge_log_path, "w")
    processes = []
    g = None
    console = []
    try:
        processes.append(subprocess.Popen(
            [BIN, "serve", "-v", "--no-advertise", "--listen", f"127.0.0.1:{port}",
             "--control", os.path.join(work, "c.sock"), "--virtual", f"dfu={firmware}"],
            stdout=server_log, stderr=subprocess.STDOUT))
        follower = LogFollower(server_log_path)
        # By bus id, so the bridge follows the board (the default; no flag needed).
        bridge, redir_args = guest.redir_bridge(port, "0-1", socket_path, bridge_log)
        qemu_args = ["-device", "qemu-xhci,id=xhci"] + redir_args
        processes.append(bridge)
        checks.check("the bridge listens", os.path.exists(socket_path))
        script = (SCRIPT.replace("__RUNTIME__", RUNTIME).replace("__RUNTIME_PID__", RUNTIME.split(":")[1]))
        g = guest.Guest("dfu-redir", script, files={image: "/fw.bin"}, timeout=900, qemu_args=qemu_args)
        while True:
            line = g.wait_for("", 600)
            console.append((time.time(), line))
            if "@@DONE" in line:
                break
        section = check_flash(checks, console, ["udevd"], firmware, digest, download_succeeded)

        timings = reenumeration_times(console, follower)
        for what, from_export, gap in timings:
            print(f"re-enumeration into {what}: the guest saw the new device {from_export * 1000:.0f} ms after the "
                  f"server's export, {gap * 1000:.0f} ms after the old one left its device list")
        checks.check("three re-enumerations seen by the guest", len(timings) >= 3, timings)
        checks.check(f"each within {REENUMERATION_BOUND} s of the export",
                     all(0 <= took <= REENUMERATION_BOUND for _, took, _ in timings), timings)
        with open(bridge_log_path, errors="replace") as f:
            bridge_text = f.read()
        back = re.findall(r"back_ms=(\d+)", bridge_text)
        print(f"bridge: from the device going away to its new import: {', '.join(back)} ms")
        checks.check("the bridge followed each re-enumeration", len(back) >= 3, bridge_text[-1500:])
        checks.check("one guest connection throughout",
                     bridge_text.count("guest connected") == 1 and "guest session ended" not in bridge_text,
                     bridge_text[-1500:])
        checks.check("no malformed packet or failure in the bridge",
                     "malformed" not in bridge_text and "ERROR" not in bridge_text, bridge_text[-1500:])
        dmesg = section("DMESG")
        checks.check("no USB errors in the guest's kernel log",
                     "error" not in dmesg.lower() and "unable to enumerate" not in dmesg.lower(), dmesg[-800:])
        checks.check("guest script exit code", g.finish(60) == 0)
    except Exception as error:
        checks.check("dfu redir test ran to the end", False, error)
    finally:
        if g:
            g.kill()
        guest.stop(processes)
        server_log.close()
        bridge_log.close()
    if checks.failed:
        print(f"logs: {guest.LOGS}/dfu-redir.*")
    checks.exit()


# dfu-util's last lines after a download whose device waited for its reset (dfuMANIFEST-WAIT-RESET).
SUCCESS_TAIL = ["Resetting USB to switch back to runtime mode", "Done!"]
# Lines dfu-util prints when something failed (warnx/errx say "dfu-util: ..."; its two
# suffix warnings are about the image file, which has no DFU suffix, and harmless).
HARMLESS = ("dfu-util: Warning: Invalid DFU suffix signature",
            "dfu-util: A valid DFU suffix will be required in a future dfu-util release")


def download_succeeded(rc, output):
    """Whether `dfu-util -D` flashed the board: exit 0, or exit 74 (EX_IOERR) with its success
    lines last and no error line. Debian 12's dfu-util 0.11 resets the board after
    manifestation (dfuload_do_dnload in src/dfu_load.c, case DFU_STATE_dfuMANIFEST_WAIT_RST)
    and returns libusb_reset_device's result: LIBUSB_ERROR_NOT_FOUND, which it prints nothing
    for, whenever the board re-enumerates on that reset (Linux's usb_reset_device returns
    -ENODEV when the descriptors changed, "device firmware changed"), and main() (src/main.c)
    maps any negative result to EX_IOERR. A board with bitManifestationTolerant=0 that leaves
    dfuMANIFEST-WAIT-RESET on the reset, as the DFU 1.1 state diagram has it, does that on a
    local port too; the bridge passes the guest's reset to the device (usbip-host's port
    reset request), so the guest sees what it would see with the board plugged into it."""
    if rc is None:
        return False, "dfu-util -D did not finish"
    lines = [line.strip() for line in output.replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("dfu-util: ") and line not in HARMLESS]
    errors += [line for line in lines if "error resetting" in line or "Lost device" in line or "failed" in line]
    if rc == 0 and not errors:
        return True, "exit 0"
    if rc == 74 and lines[-len(SUCCESS_TAIL):] == SUCCESS_TAIL and not errors:
        return True, ("exit 74 after its success lines and no error line: dfu-util 0.11's reset of a board "
                      "that re-enumerates on it returns LIBUSB_ERROR_NOT_FOUND")
    return False, f"exit {rc}, last lines {lines[-3:]}, error lines {errors}"


def reenumeration_times(console, follower):
    """(new VID:PID, seconds from the server's "exported again" line to the guest's device list
    showing it, seconds from the old device leaving that list to the new one in it)."""
    exports = follower.times_of("exported again under the same bus id")
    seen = []
    previous, left = None, None
    for at, line in console:
        if not line.startswith("@@DEVICES"):
            continue
        ids = set(re.findall(r"=(\w{4}:\w{4})", line))
        current = next((i for i in (BOOTLOADER, RUNTIME) if i in ids), None)
        if current is None and previous and left is None:
            left = at
        if current and previous and current != previous:
            seen.append((current, at, at - (left or at)))
        if current:
            previous, left = current, None
    return [(what, at - exported, gap) for (what, at, gap), exported in zip(seen, exports)]


if __name__ == "__main__":
    main()
