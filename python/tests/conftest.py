"""Fixtures that run the real programs: `usbwire serve` with a device socket, device
processes, and the commands that look at the device from outside (`usbwire list`,
`usbwire describe`, the `urb` example that moves URBs through an import).

USBWIRE_BIN names the usbwire binary (default: target/release/usbwire of this
repository); USBWIRE_URB the urb example (default: examples/urb beside it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, List, Optional

import pytest

REPO = Path(__file__).resolve().parents[2]
DEVICES = Path(__file__).resolve().parent / "devices"


def program(variable: str, default: Path, build: str) -> str:
    path = os.environ.get(variable) or str(default)
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path} is missing: {build} (or set {variable})")
    return path


def usbwire_bin() -> str:
    return program("USBWIRE_BIN", REPO / "target/release/usbwire", "cargo build --release -p usbwire-cli")


def urb_bin() -> str:
    default = Path(usbwire_bin()).parent / "examples" / "urb"
    return program("USBWIRE_URB", default, "cargo build --release -p usbwire-client --examples")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.05)


class Served:
    """A running `usbwire serve` with one external device socket (bus id 0-1)."""

    busid = "0-1"

    def __init__(self, work: Path) -> None:
        self.work = work
        self.socket = str(work / "device.sock")
        self.port = free_port()
        self.remote = f"127.0.0.1:{self.port}"
        self.log = work / "server.log"
        self.processes: List[subprocess.Popen] = []
        command = [usbwire_bin(), "serve", "-v", "--listen", self.remote, "--no-advertise",
                   "--control", str(work / "control.sock"), "--bind-state", str(work / "binds"),
                   "--virtual", f"external=unix:{self.socket}"]
        with open(self.log, "w") as log:
            self.server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        wait_until(lambda: os.path.exists(self.socket) or self.server.poll() is not None, 20, "server socket")
        assert self.server.poll() is None, self.log.read_text()

    def run(self, *arguments: str, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run([usbwire_bin(), *arguments], capture_output=True, text=True, timeout=30)
        if check:
            assert done.returncode == 0, f"usbwire {' '.join(arguments)}: {done.stderr}"
        return done

    def listed(self) -> List[dict]:
        return json.loads(self.run("list", "-r", self.remote, "--json").stdout)["devices"]

    def wait_listed(self, present: bool, timeout: float = 15) -> Optional[dict]:
        def ours():
            found = [d for d in self.listed() if d["busid"] == self.busid]
            return (found[0] if found else None) if present else (not found)

        return wait_until(ours, timeout, f"{self.busid} listed={present}")

    def urb(self, *steps: str) -> List[str]:
        done = subprocess.run([urb_bin(), self.remote, self.busid, *steps], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"urb {' '.join(steps)}: {done.stderr}"
        return done.stdout.splitlines()

    def start(self, *command: str, env: Optional[dict] = None) -> subprocess.Popen:
        """A device process, told where the socket is by USBWIRE_DEVICE_SOCKET."""
        environment = {**os.environ, "USBWIRE_DEVICE_SOCKET": self.socket, **(env or {})}
        path = self.work / f"device-{len(self.processes)}.log"
        with open(path, "w") as log:
            process = subprocess.Popen(list(command), env=environment, stdout=log, stderr=subprocess.STDOUT)
        process.log_path = path  # type: ignore[attr-defined]
        self.processes.append(process)
        return process

    def python(self, script: str, *arguments: str, env: Optional[dict] = None) -> subprocess.Popen:
        return self.start(sys.executable, str(DEVICES / script), *arguments, env=env)

    def logs(self) -> str:
        return "\n".join(f"--- {path.name}\n{path.read_text()}" for path in sorted(self.work.glob("*.log")))

    def stop(self) -> None:
        for process in [*self.processes, self.server]:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


@pytest.fixture
def served(request) -> Iterator[Served]:
    # A short directory: a Unix socket's path is limited to 107 bytes.
    work = Path(tempfile.mkdtemp(prefix="uwpy-"))
    running = Served(work)
    try:
        yield running
    finally:
        running.stop()
        failed = getattr(request.node, "failed", False)
        if failed:
            print(running.logs())
        shutil.rmtree(work, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        item.failed = True
