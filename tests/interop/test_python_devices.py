#!/usr/bin/env python3
"""Python devices in a real kernel: Facedancer's shipped keyboard, mass-storage and FTDI device,
run with BACKEND=usbwire against `usbwire serve --virtual external=unix:…` on the host, and
attached by the kernel's own client (usbip + vhci-hcd, Debian's kernel under QEMU). The guest
sees the keyboard's key presses as input events, mounts the disk, reads the file the host put
in its image and writes one that the host then finds in the image, and reads back from
/dev/ttyUSB0 (ftdi_sio) what it wrote to the FTDI device; dmesg stays clean.

Run: python3 tests/interop/test_python_devices.py
     (USBWIRE_BIN=path/to/usbwire; USBWIRE_PYTHON=a python with `pip install './python[facedancer]'`,
     default target/pyenv/bin/python as scripts/test.sh makes it)
"""

import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import guest  # noqa: E402
from test_core_server import KEYCODES, decode_keys  # noqa: E402

BIN = guest.BIN
PYTHON = os.environ.get("USBWIRE_PYTHON", os.path.join(guest.ROOT, "target", "pyenv", "bin", "python"))
WORD = "facedancer"
HOST_TEXT = "put in the image by the host"
GUEST_TEXT = "written by the guest through a Facedancer disk"

# Facedancer's keyboard (its class, unmodified) typing WORD once the file named by argv[1] exists.
KEYBOARD_SCRIPT = r"""
import asyncio, os, sys
from facedancer import main
from facedancer.devices.keyboard import USBKeyboardDevice

device = USBKeyboardDevice()
trigger, sys.argv = sys.argv[1], sys.argv[:1]  # Facedancer's main parses the arguments too

async def type_when_told():
    while not os.path.exists(trigger):
        await asyncio.sleep(0.1)
    await device.type_string("__WORD__", duration=0.1)

main(device, type_when_told())
""".replace("__WORD__", WORD)

# Facedancer's mass-storage device on a raw image, as its mass-storage example runs it.
DISK_SCRIPT = r"""
import sys
from facedancer.devices.umass import RawDiskImage, USBMassStorageDevice
from facedancer.logging import configure_default_logging

configure_default_logging(level=30)
USBMassStorageDevice(RawDiskImage(sys.argv[1], 512)).emulate()
"""

# Facedancer's FTDI device (its class, unmodified), sending back what the host writes: its
# documented way to take serial data is handle_serial_data_received.
FTDI_SCRIPT = r"""
from facedancer.devices.ftdi import FTDIDevice
from facedancer.logging import configure_default_logging

configure_default_logging(level=30)
device = FTDIDevice()
device.handle_serial_data_received = lambda data: device.transmit(bytes(data), adjust_endings=False)
device.emulate()
"""
SERIAL_TEXT = "through-a-python-ftdi"

GUEST_SCRIPT = r"""
set -u
U="usbip --tcp-port __PORT__"

echo "@@LIST-BEGIN"; $U list -r 10.0.2.2; echo "@@LIST-END"

$U attach -r 10.0.2.2 -b 0-1; check keyboard-attach $?
i=0; while ! grep -q "Non-suspicious Keyboard" /proc/bus/input/devices && [ $i -lt 100 ]; do sleep 0.2; i=$((i+1)); done
grep -q "Non-suspicious Keyboard" /proc/bus/input/devices; check keyboard-input-device $?
EV=$(awk '/Non-suspicious Keyboard/ {f=1} f && /Handlers=/ {for (i=1;i<=NF;i++) if ($i ~ /^event/) {print $i; exit}}' /proc/bus/input/devices)
(timeout 20 cat /dev/input/$EV > /tmp/events) &
sleep 0.5
echo "@@READY-FOR-TYPE"
wait
echo "@@EVENTS-BEGIN"; od -A n -t x1 -v /tmp/events; echo "@@EVENTS-END"

$U attach -r 10.0.2.2 -b 0-2; check disk-attach $?
wait_path /sys/block/sda 150; check disk-block-device $?
sleep 1
mount -t ext2 /dev/sda /mnt; check disk-mount $?
echo "@@HOST-FILE $(cat /mnt/host.txt)"
echo "__GUEST_TEXT__" > /mnt/guest.txt && sync; check disk-write $?
umount /mnt; check disk-umount $?

$U attach -r 10.0.2.2 -b 0-3; check ftdi-attach $?
wait_path /dev/ttyUSB0 150; check ftdi-tty $?
stty -F /dev/ttyUSB0 raw -echo 115200
(timeout 10 cat /dev/ttyUSB0 > /tmp/serial) &
sleep 1
printf '__SERIAL_TEXT__' > /dev/ttyUSB0
wait
echo "@@SERIAL [$(cat /tmp/serial)]"
echo "@@DMESG-BEGIN"; dmesg | grep -iE "usb|vhci|given back|report|error|sd " ; echo "@@DMESG-END"
exit 0
"""


def wait_listed(port, wanted, timeout=30):
    deadline = time.time() + timeout
    while True:
        listing = subprocess.run([BIN, "list", "-r", f"127.0.0.1:{port}"], capture_output=True, text=True).stdout
        if all(ids in listing for ids in wanted) or time.time() > deadline:
            return listing
        time.sleep(0.2)


def main():
    guest.require(BIN)
    if not os.access(PYTHON, os.X_OK):
        sys.exit(f"missing {PYTHON}: make it with scripts/test.sh's Python step, or set USBWIRE_PYTHON")
    guest.build()
    checks = guest.Checks()
    work = guest.scratch("usbwire-python-")
    files = os.path.join(work, "files")
    os.makedirs(files)
    with open(os.path.join(files, "host.txt"), "w") as f:
        f.write(HOST_TEXT + "\n")
    image = os.path.join(work, "disk.img")
    subprocess.run(["mke2fs", "-q", "-t", "ext2", "-d", files, image, "4096"], check=True)
    for name, text in (("keyboard.py", KEYBOARD_SCRIPT), ("disk.py", DISK_SCRIPT), ("ftdi.py", FTDI_SCRIPT)):
        with open(os.path.join(work, name), "w") as f:
            f.write(text)
    trigger = os.path.join(work, "type-now")
    port = guest.free_port()
    logs = {name: open(os.path.join(guest.LOGS, f"python-devices.{name}.log"), "w") for name in ("server", "keyboard", "disk", "ftdi")}
    server = subprocess.Popen(
        [BIN, "serve", "-v", "--listen", f"127.0.0.1:{port}", "--no-advertise", "--control", os.path.join(work, "c.sock"),
         "--bind-state", os.path.join(work, "binds"),
         "--virtual", f"external=unix:{work}/keyboard.sock", "--virtual", f"external=unix:{work}/disk.sock",
         "--virtual", f"external=unix:{work}/ftdi.sock"],
        stdout=logs["server"], stderr=subprocess.STDOUT)
    devices = []
    g = None
    try:
        for _ in range(100):
            if os.path.exists(f"{work}/ftdi.sock"):
                break
            time.sleep(0.1)
        for name, arguments in (("keyboard", [trigger]), ("disk", [image]), ("ftdi", [])):
            env = {**os.environ, "BACKEND": "usbwire", "USBWIRE_DEVICE_SOCKET": f"{work}/{name}.sock"}
            devices.append(subprocess.Popen([PYTHON, os.path.join(work, f"{name}.py"), *arguments], env=env,
                                            stdout=logs[name], stderr=subprocess.STDOUT))
        listing = wait_listed(port, ["0-1", "(610b:4653)", "0-2", "(8107:5051)", "0-3", "(0403:6001)"])
        checks.check("the three Facedancer devices listed on the host",
                     all(ids in listing for ids in ("(610b:4653)", "(8107:5051)", "(0403:6001)")), listing)
        g = guest.Guest("python-devices", GUEST_SCRIPT.replace("__PORT__", str(port)).replace("__GUEST_TEXT__", GUEST_TEXT)
                        .replace("__SERIAL_TEXT__", SERIAL_TEXT),
                        timeout=600)
        text = g.collect("@@LIST-BEGIN", "@@LIST-END", 120)
        checks.check("the guest's usbip list -r shows both, with their classes",
                     "610b:4653" in text and "8107:5051" in text and "(03/00/00)" in text and "(08/06/50)" in text, text)

        def guest_check(name, timeout=180):
            line = g.wait_for(f"@@CHECK {name} ", timeout)
            checks.check(f"guest: {name}", " PASS" in line, line)

        for name in ["keyboard-attach", "keyboard-input-device"]:
            guest_check(name)
        g.wait_for("@@READY-FOR-TYPE", 60)
        open(trigger, "w").close()
        presses = decode_keys(g.collect("@@EVENTS-BEGIN", "@@EVENTS-END", 60).splitlines())
        expected = [KEYCODES[c] for c in WORD]
        checks.check("what Facedancer's keyboard types arrives as key presses", presses == expected,
                     f"expected {expected}, got {presses}")

        for name in ["disk-attach", "disk-block-device", "disk-mount"]:
            guest_check(name)
        line = g.wait_for("@@HOST-FILE", 180)
        checks.check("the guest reads the host's file from the Facedancer disk", line.endswith(HOST_TEXT), line)
        for name in ["disk-write", "disk-umount", "ftdi-attach", "ftdi-tty"]:
            guest_check(name)
        line = g.wait_for("@@SERIAL", 60)
        checks.check("what the guest writes to /dev/ttyUSB0 comes back from Facedancer's FTDI device",
                     line.endswith(f"[{SERIAL_TEXT}]"), line)
        dmesg = g.collect("@@DMESG-BEGIN", "@@DMESG-END", 60)
        for bad in ("given back", "was too short", "I/O error", "reset full-speed"):
            checks.check(f"no '{bad}' in dmesg", bad not in dmesg, dmesg)
        checks.check("guest script exit code", g.finish(60) == 0)
        out = subprocess.run(["debugfs", "-R", "cat /guest.txt", image], capture_output=True, text=True)
        checks.check("the guest's file is in the image behind the Facedancer disk", out.stdout.strip() == GUEST_TEXT,
                     out.stdout + out.stderr)
    except Exception as error:
        checks.check("python devices test ran to the end", False, error)
    finally:
        if g:
            g.kill()
        for process in [*devices, server]:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
    checks.exit()


if __name__ == "__main__":
    main()
