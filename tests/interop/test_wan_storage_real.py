#!/usr/bin/env python3
"""A real USB flash drive over a long link (50 ms round trip) with the storage
accelerator: test_wan_storage.py's checks, on a drive exported through usbfs.

An exporter guest has QEMU's `usb-storage` on xHCI (a 64 MiB raw image) and
runs `usbwire serve --bind 46f4:0001`, which exports the drive through usbfs;
its port 3240 is forwarded to host loopback, and cutproxy.py delays that by
25 ms in each direction. A vhci-hcd guest runs `usbwire attach -r
10.0.2.2:PROXY -b BUSID` (accelerator on) and, with test_wan_storage.py's
guest functions: 4 MiB read and 2 MiB of random data written with O_DIRECT,
timed, the written range read back equal; reads right after an overwrite of
a range just read return the new bytes (1 MiB at once, 64 KiB in 4 KiB
pieces); ext4 made on the first 32 MiB with Debian's mkfs.ext4, three files
(3 MiB random among them) written and synced, unmounted, caches dropped,
mounted again: the sha256s match; `e2fsck -fn` clean; detach: the disk goes
and the relay ends; dmesg clean. The relay's "mass storage accelerated" line
counts commands_pipelined > 0, the exporter's server logged `storage=true`,
and once the exporter powered off the files are in the drive's image with
the guest's sha256s (debugfs on the host). The speeds are printed, not
asserted. About 1 minute.

Run: python3 tests/interop/test_wan_storage_real.py   (USBWIRE_BIN=path/to/usbwire)
"""

import json
import os
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cutproxy  # noqa: E402
import guest  # noqa: E402
import test_wan_storage as wan  # noqa: E402

BIN = guest.BIN
# QEMU's usb-storage.
FLASH_ID = ("46f4", "0001")

EXPORTER_SCRIPT = r"""
set -u
usbwire serve -v --listen 0.0.0.0:3240 --no-advertise --bind 46f4:0001 > /tmp/serve.log 2>&1 &
echo "@@SERVER-UP"
# Up until the host says it is done (it starts listening on __DONE__).
i=0; while [ $i -lt 1200 ]; do nc -w 1 10.0.2.2 __DONE__ </dev/null >/dev/null 2>&1 && break; sleep 0.5; i=$((i+1)); done
echo "@@SERVE-LOG-BEGIN"; cat /tmp/serve.log; echo "@@SERVE-LOG-END"
exit 0
"""

ATTACH_SCRIPT = wan.FUNCTIONS + r"""
echo "@@MODE flash"
attach flash usbwire attach -r 10.0.2.2:__PORT__ -b __BUSID__ && uses flash fs
detach flash usbwire
dmesg_clean
echo "@@END"
exit 0
"""

EXPECTED = [f"flash-{name}" for name in wan.PER_MODE + wan.FILESYSTEM] + ["dmesg-clean"]


def exported_flash_drive(port, exporter, timeout=180, device_id=FLASH_ID):
    """The bus id under which the exporter's server lists the flash drive (or the device of
    `device_id`, VID and PID). Under TCG on a loaded machine the exporter's kernel may take long
    to enumerate it."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if exporter.proc.poll() is not None:
            raise RuntimeError(f"the exporter guest stopped (console: {exporter.console_path})")
        out = subprocess.run([BIN, "list", "-r", f"127.0.0.1:{port}", "--json"], capture_output=True, text=True)
        if out.returncode == 0:
            for device in json.loads(out.stdout)["devices"]:
                if (device["vendor_id"], device["product_id"]) == device_id:
                    return device["busid"]
        time.sleep(1)
    raise RuntimeError(f"the exporter's server did not list {':'.join(device_id)} within {timeout} s")


def main():
    guest.require(BIN)
    guest.build()
    checks = guest.Checks()
    work = guest.scratch("usbwire-wan-real-")
    image = os.path.join(work, "flash.img")
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    port, done_port = guest.free_port(), guest.free_port()
    proxy = cutproxy.CutProxy(("127.0.0.1", port), delay=wan.DELAY)
    done = socket.socket()
    exporter = attacher = None
    sums = {}
    try:
        exporter = guest.Guest(
            "wan-storage-exporter", EXPORTER_SCRIPT.replace("__DONE__", str(done_port)),
            files={BIN: "/usr/bin/usbwire"}, hostfwd={3240: port}, timeout=600,
            qemu_args=["-device", "qemu-xhci,id=xhci", "-drive", f"if=none,id=flash,format=raw,file={image}",
                       "-device", "usb-storage,bus=xhci.0,drive=flash"])
        exporter.wait_for("@@SERVER-UP", 180)
        busid = exported_flash_drive(port, exporter)
        proxy_port = proxy.start()
        script = ATTACH_SCRIPT.replace("__PORT__", str(proxy_port)).replace("__BUSID__", busid)
        attacher = guest.Guest("wan-storage-vhci", script, files={BIN: "/usr/bin/usbwire", **wan.E2FS}, timeout=600)
        times, relay, sums, _ = wan.read_console(attacher, checks, EXPECTED)
        checks.check("vhci guest script exit code", attacher.finish(60) == 0)
        wan.print_table(times, ("flash",), "A real USB flash drive (QEMU usb-storage through usbfs)")
        wan.relay_pipelined(checks, relay.get("flash", ""), "flash drive's")
        done.bind(("127.0.0.1", done_port))
        done.listen(4)

        def hang_up():
            # Accept and close at once, so the exporter's nc returns.
            try:
                while True:
                    conn, _ = done.accept()
                    conn.close()
            except OSError:
                pass

        threading.Thread(target=hang_up, daemon=True).start()
        served = exporter.collect("@@SERVE-LOG-BEGIN", "@@SERVE-LOG-END", 120)
        agreed = [line for line in served.splitlines() if "stream transforms" in line]
        for line in agreed:
            print(f"exporter: {line.strip()}")
        checks.check("the exporter's server granted storage to the import (storage=true)",
                     bool(agreed) and "storage=true" in agreed[0], served[-2000:])
        checks.check("exporter guest exit code", exporter.finish(60) == 0)
        checks.check("every import went through the delaying proxy", proxy.stats()["connections"] >= 1)
    except Exception as error:  # noqa: BLE001 - reported as a failed check
        checks.check("the test ran to the end", False, error)
    finally:
        done.close()
        for g in (attacher, exporter):
            if g:
                g.kill()
        proxy.stop()
    wan.image_holds_files(checks, image, sums, "the flash drive's image")
    print(f"logs: {guest.LOGS}/wan-storage-exporter.console.log, {guest.LOGS}/wan-storage-vhci.console.log")
    checks.exit()


if __name__ == "__main__":
    main()
