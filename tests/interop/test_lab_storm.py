#!/usr/bin/env python3
"""A lab coming back after a power cut (issue 36): every server of the lab
registers at the same moment on one etcd member (Debian's etcd-server), at a
scale two cores afford, with `usbwire bench --registry` — 1 000 servers of 10
devices, each server with its own publisher and etcd connection, all started at
once, then 1 000 clients reserving at once.

- The storm is survived: no server's lease runs out while the fleet registers
  (no entry leaves the registry meanwhile), and no server logs the registry
  as unreachable.
- Every device is listed, once: the bench's own check (the fleet lists exactly
  the servers and devices registered, or it exits non-zero) and its report.
- Every client gets a device (0 failed, 0 told none free), no device twice
  (the bench's exclusivity check).

No guest: the registry is the host's. Run: python3 tests/interop/test_lab_storm.py
(USBWIRE_BIN=path/to/usbwire)
"""

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import guest  # noqa: E402

BIN = guest.BIN
ETCD = shutil.which("etcd") or "/usr/bin/etcd"
SERVERS = 1000
DEVICES_PER_SERVER = 10
CLIENTS = 1000


def wait_healthy(port, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                if json.load(answer).get("health") == "true":
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"etcd not healthy within {timeout} s (log {guest.LOGS}/lab-storm.etcd.log)")


def main():
    guest.require(BIN, ETCD)
    checks = guest.Checks()
    os.makedirs(guest.LOGS, exist_ok=True)
    work = guest.scratch("usbwire-lab-storm-")
    client_port, peer_port = guest.free_port(), guest.free_port()
    etcd_log = open(os.path.join(guest.LOGS, "lab-storm.etcd.log"), "w")
    etcd = subprocess.Popen(
        [ETCD, "--name", "storm", "--data-dir", os.path.join(work, "etcd"),
         "--listen-client-urls", f"http://127.0.0.1:{client_port}",
         "--advertise-client-urls", f"http://127.0.0.1:{client_port}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
         "--initial-cluster", f"storm=http://127.0.0.1:{peer_port}"],
        stdout=etcd_log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(client_port)
        registry = f"etcd://127.0.0.1:{client_port}/storm-test"
        started = time.time()
        bench = subprocess.run(
            [BIN, "bench", "--registry", registry, "--servers", str(SERVERS),
             "--devices-per-server", str(DEVICES_PER_SERVER), "--clients", str(CLIENTS), "--json"],
            capture_output=True, text=True, timeout=900)
        took = time.time() - started
        with open(os.path.join(guest.LOGS, "lab-storm.bench.log"), "w") as log:
            log.write(bench.stdout + "\n--- stderr\n" + bench.stderr)
        checks.check("the bench ran through every phase (every device listed, none held twice)",
                     bench.returncode == 0, f"exit {bench.returncode}: {bench.stderr[-600:]}")
        if bench.returncode == 0:
            report = json.loads(bench.stdout)
            devices = SERVERS * DEVICES_PER_SERVER
            registration = report["phases"]["registration"]
            print(f"{SERVERS} servers x {DEVICES_PER_SERVER} devices registered in {registration['seconds']:.1f} s "
                  f"(last key written at {report['settled_seconds']:.1f} s), "
                  f"{report['reservations_per_second']:.0f} reservations/s; whole run {took:.0f} s", flush=True)
            checks.check(f"all {devices} devices registered", registration["ops"] == devices, registration)
            checks.check("no lease ran out while the fleet registered", report["registration_lost"] == 0,
                         report["registration_lost"])
            checks.check(f"all {CLIENTS} clients reserved a device",
                         report["reserved"] == CLIENTS and report["failed"] == 0 and report["none_free"] == 0,
                         {k: report[k] for k in ("reserved", "failed", "none_free", "errors")})
        unreachable = [line for line in bench.stderr.splitlines() if "unreachable" in line]
        checks.check("no server found the registry unreachable", not unreachable, unreachable[:3])
    finally:
        guest.stop([etcd])
    checks.exit()


if __name__ == "__main__":
    main()
