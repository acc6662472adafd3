"""Facedancer's device scripts, unmodified, on the usbwire backend: served by the real
`usbwire serve` and checked from outside (list, describe, URBs through an import)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import DEVICES, urb_bin

from facedancer.devices.keyboard import USBKeyboardDevice

SET_CONFIGURATION_1 = "control-out:0009010000000000"
BACKEND = {"BACKEND": "usbwire"}
REPORT = len(USBKeyboardDevice()._generate_hid_report())


def data(line: str) -> str:
    return line.rsplit("data=", 1)[1]


def test_the_shipped_keyboard_enumerates_answers_control_requests_and_reports(served):
    keyboard = USBKeyboardDevice()
    process = served.start(sys.executable, "-m", "facedancer.devices.keyboard", env=BACKEND)
    listed = served.wait_listed(True)
    assert (listed["vendor_id"], listed["product_id"]) == (f"{keyboard.vendor_id:04x}", f"{keyboard.product_id:04x}")
    assert keyboard.product_string.string in served.run("describe", "-r", served.remote, "-b", served.busid).stdout
    lines = served.urb("control-in:8006000100001200", SET_CONFIGURATION_1, "control-in:8008000000000100", f"in:3:{REPORT}")
    assert data(lines[0]) == keyboard.get_descriptor().hex()
    assert lines[2] == "control-in:8008000000000100 status=0 data=01"
    assert lines[3] == f"in:3:{REPORT} status=0 data={keyboard._generate_hid_report().hex()}"
    process.terminate()
    process.wait(10)
    served.wait_listed(False)


def test_the_shipped_keyboard_types_through_an_import(served):
    served.start(sys.executable, "-m", "usbwire.facedancer", str(DEVICES / "facedancer_typing.py"))
    served.wait_listed(True)
    lines = served.urb(SET_CONFIGURATION_1, *[f"in:3:{REPORT}"] * 300)
    pressed = []
    for line in lines[1:]:
        assert " status=0 " in line, line
        key = bytes.fromhex(data(line))[2]
        if key and (not pressed or pressed[-1] != key):
            pressed.append(key)
    # HID usage ids: a = 0x04, so "u" = 0x18 …; Enter = 0x28.
    usbwire = [0x18, 0x16, 0x05, 0x1A, 0x0C, 0x15, 0x08, 0x28]
    assert any(pressed[at : at + 8] == usbwire for at in range(len(pressed))), pressed


def test_a_minimal_device_script_runs_unmodified_with_backend_usbwire(served):
    served.python("facedancer_minimal.py", env=BACKEND)
    listed = served.wait_listed(True)
    assert (listed["vendor_id"], listed["product_id"]) == ("1209", "0010")
    assert "Example USB Device" in served.run("describe", "-r", served.remote, "-b", served.busid).stdout
    payload = bytes(range(100)).hex()  # two packets: 64 + 36
    lines = served.urb(SET_CONFIGURATION_1, "control-out:4002000000000500:68656c6c6f", "control-in:c001000000004000",
                       f"out:1:{payload}", "in:1:64", "in:1:64", "control-in:c063000000000100")
    assert data(lines[2]) == b"device sent response: hello".hex()
    assert data(lines[3]) + data(lines[4]) + data(lines[5]) == payload[:128] + payload[128:], lines
    assert "status=-32" in lines[6], "an unhandled request stalls"


def test_the_shipped_ftdi_device_enumerates_and_takes_serial_data(served):
    served.start(sys.executable, "-m", "facedancer.devices.ftdi", env=BACKEND)
    listed = served.wait_listed(True)
    assert (listed["vendor_id"], listed["product_id"]) == ("0403", "6001")
    assert "FTDI emulation" in served.run("describe", "-r", served.remote, "-b", served.busid).stdout
    lines = served.urb(SET_CONFIGURATION_1, "control-in:c00a000000000100", "out:2:68656c6c6f")
    assert lines[1].startswith("control-in:c00a000000000100 status=0 data=") and len(data(lines[1])) == 2
    assert lines[2] == "out:2:68656c6c6f status=0 data="


def test_the_shipped_mass_storage_device_reads_sectors_through_an_import(served):
    image = Path(served.work) / "disk.img"
    image.write_bytes(os.urandom(1 << 20))
    served.start(sys.executable, "-m", "usbwire.facedancer", str(DEVICES / "facedancer_umass.py"), str(image))
    served.wait_listed(True)
    read_sectors = Path(urb_bin()).parent / "read_sectors"
    done = subprocess.run([str(read_sectors), served.remote, served.busid, "3", "16"], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout == image.read_bytes()[3 * 512 : 19 * 512]
