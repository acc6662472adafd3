"""Devices written with usbwire.device alone, served by the real `usbwire serve` and checked
from outside: `usbwire list` and `usbwire describe`, URBs through an import, and the device's
coming and going with its process."""

from __future__ import annotations

import time

import pytest

from usbwire.device import Device, DeviceProtocolError

SET_CONFIGURATION_1 = "control-out:0009010000000000"


def test_the_echo_device_is_listed_described_and_echoes(served):
    served.python("echo.py", "PY-7")
    listed = served.wait_listed(True)
    assert (listed["vendor_id"], listed["product_id"]) == ("1209", "0008"), listed
    described = served.run("describe", "-r", served.remote, "-b", served.busid).stdout
    for text in ("usbwire", "Python echo", "PY-7"):
        assert text in described, described
    payload = b"through the socket and back".hex()
    lines = served.urb(SET_CONFIGURATION_1, f"out:2:{payload}", "in:1:512")
    assert lines == [f"{SET_CONFIGURATION_1} status=0 data=", f"out:2:{payload} status=0 data=",
                     f"in:1:512 status=0 data={payload}"]


def test_control_requests_stalls_and_an_in_endpoint_that_naks_until_ready(served):
    served.python("vendor.py")
    served.wait_listed(True)
    started = time.monotonic()
    lines = served.urb(SET_CONFIGURATION_1, "control-out:4002000000000500:68656c6c6f", "control-in:c001000000004000",
                       "control-in:c003000000000400", "in:3:8")
    waited = time.monotonic() - started
    assert lines[1:] == ["control-out:4002000000000500:68656c6c6f status=0 data=",
                         "control-in:c001000000004000 status=0 data=68656c6c6f",
                         "control-in:c003000000000400 status=-32 data=",
                         "in:3:8 status=0 data=01020304"]
    assert waited >= 0.5, "the interrupt IN waited for its report"


def test_a_halted_endpoint_stalls_until_its_halt_is_cleared(served):
    served.python("echo.py")
    served.wait_listed(True)
    halt, clear = "control-out:0203000081000000", "control-out:0201000081000000"
    lines = served.urb(SET_CONFIGURATION_1, halt, "control-in:8200000081000200", "in:1:512", clear,
                       "control-in:8200000081000200", "out:2:4f4b", "in:1:512")
    assert [line.split(" ", 1)[1] for line in lines[1:]] == [
        "status=0 data=", "status=0 data=0100", "status=-32 data=", "status=0 data=", "status=0 data=0000",
        "status=0 data=", "status=0 data=4f4b"]


def test_the_device_vanishes_with_its_process_and_returns_when_it_reconnects(served):
    first = served.python("echo.py", "PY-1")
    served.wait_listed(True)
    first.terminate()
    first.wait(10)
    served.wait_listed(False)
    again = served.python("echo.py", "PY-2")
    served.wait_listed(True)
    assert "PY-2" in served.run("describe", "-r", served.remote, "-b", served.busid).stdout
    assert again.poll() is None


def test_a_second_process_is_refused_and_says_why(served):
    served.python("echo.py")
    served.wait_listed(True)
    second = served.python("echo.py")
    assert second.wait(15) != 0
    said = second.log_path.read_text()
    assert "refused by the usbwire server: a device process is already connected" in said, said


def test_the_device_process_ends_cleanly_when_the_server_stops(served):
    process = served.python("echo.py")
    served.wait_listed(True)
    served.server.terminate()
    assert process.wait(15) == 0, served.logs()


def test_no_server_at_the_socket_is_an_error_that_says_what_to_do(tmp_path):
    device = Device(vendor_id=0x1209, product_id=0x0008)
    with pytest.raises(DeviceProtocolError, match="usbwire serve --virtual external=unix:"):
        device.run(str(tmp_path / "nobody.sock"))
