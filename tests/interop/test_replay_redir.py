#!/usr/bin/env python3
"""A disk recorded once and replayed to a VM's own usb-storage through the usbredir bridge: no
usbip in the guest, no disk behind the replay.

Recording: `usbwire serve --virtual disk=IMAGE --capture DIR` (an ext4 image made on the host
with test_replay_disk.py's files), a `usbwire redir` bridge importing the disk and listening on
a Unix socket, and a guest (Debian's kernel under TCG) whose QEMU has a `usb-redir` device
dialling that socket: the guest's kernel finds the disk at boot, mounts it read-only, hashes the
files and unmounts. The bridge is stopped (the import ends) and the server with it. Replay: the
same with `--virtual replay=CAPTURE,mode=strict` behind a new bridge and a fresh guest.

Checked: the guest mounts the disk in both; the files' SHA-256 are the image's in the recording
and the same in the replay; the replay's report has 0 divergences and nothing of the recording
unasked; the replay server logs `replay ended as recorded`; dmesg has no I/O error or reset.
The bridge runs its storage accelerator and descriptor snapshot in both phases, so the recording
holds its reads ahead, which the replay's bridge sends again the same way.

Run: python3 tests/interop/test_replay_redir.py   (USBWIRE_BIN=path/to/usbwire)
"""

import hashlib
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import guest  # noqa: E402
import test_replay_disk as disk  # noqa: E402
from test_replay_kernel import listening  # noqa: E402

BIN = guest.BIN

GUEST_SCRIPT = r"""
set -u
wait_for '[ -e /sys/block/sda ] && [ -e /dev/sda ] && [ "$(cat /sys/block/sda/size)" != 0 ]' 600; check disk $?
mount -t ext4 -o ro /dev/sda /mnt > /tmp/mount.out 2>&1; check mount $? "$(cat /tmp/mount.out)"
echo "@@SHA-BEGIN"; (cd /mnt && sha256sum __FILES__); echo "@@SHA-END"
umount /mnt; check umount $?
echo "@@DMESG-BEGIN"
dmesg | grep -iE "usb [0-9]-|usb-storage|scsi|sd |sda|EXT4|error|reset"
echo "@@DMESG-END"
exit 0
"""


def run_phase(name, server_args, work, checks):
    """One server, one bridge, one guest: the files' SHA-256 as the guest read them, and the
    server's log path (the server and bridge are stopped on return, so the import has ended)."""
    port = guest.free_port()
    bridge_socket = os.path.join(work, f"{name}.redir.sock")
    server_log = os.path.join(guest.LOGS, f"replay-redir.{name}.server.log")
    bridge_log = os.path.join(guest.LOGS, f"replay-redir.{name}.bridge.log")
    processes = []
    g = None
    got = {}
    try:
        with open(server_log, "w") as out:
            processes.append(subprocess.Popen(
                [BIN, "serve", "-v", "--listen", f"127.0.0.1:{port}", "--no-advertise",
                 "--control", os.path.join(work, f"{name}.sock")] + server_args,
                stdout=out, stderr=subprocess.STDOUT))
        checks.check(f"{name}: the server listens", listening(port, processes[0]), server_log)
        with open(bridge_log, "w") as out:
            bridge, qemu_args = guest.redir_bridge(port, "0-1", bridge_socket, out, wait=30)
            processes.append(bridge)
        checks.check(f"{name}: the bridge listens", os.path.exists(bridge_socket), bridge_log)
        script = GUEST_SCRIPT.replace("__FILES__", " ".join(disk.FILES))
        g = guest.Guest(f"replay-redir-{name}", script, timeout=600, qemu_args=qemu_args)
        g.wait_for("@@BOOTED", 180)
        for step in ["disk", "mount"]:
            line = g.wait_for(f"@@CHECK {step} ", 300)
            checks.check(f"{name} guest: {step}", " PASS" in line, line)
        got = disk.hashes(g.collect("@@SHA-BEGIN", "@@SHA-END", 180))
        line = g.wait_for("@@CHECK umount ", 120)
        checks.check(f"{name} guest: umount", " PASS" in line, line)
        dmesg = g.collect("@@DMESG-BEGIN", "@@DMESG-END", 60)
        checks.check(f"{name}: no I/O error or reset in the guest's dmesg",
                     not any(w in dmesg.lower() for w in ("i/o error", "reset high-speed", "reset super")), dmesg)
        checks.check(f"{name}: guest script exit code", g.finish(60) == 0)
    finally:
        if g:
            g.kill()
        # The bridge first: its import ends, and the server writes what it owes (capture, report).
        guest.stop(processes[1:])
        guest.stop(processes[:1])
    print(f"{name}: SHA-256 {got}", flush=True)
    return got, server_log


def main():
    guest.require(BIN, "/usr/bin/qemu-system-x86_64")
    guest.build()
    checks = guest.Checks()
    os.makedirs(guest.LOGS, exist_ok=True)
    work = guest.scratch("usbwire-replay-redir-")
    image = disk.make_image(work)
    expected = {name: hashlib.sha256(data).hexdigest() for name, data in disk.FILES.items()}
    capture_dir = os.path.join(work, "capture")
    report_path = os.path.join(work, "strict.report.json")
    started = time.time()
    try:
        recorded, _ = run_phase("record", ["--capture", capture_dir, "--virtual", f"disk={image},size=16M"],
                                work, checks)
        checks.check("record: the files' SHA-256 are the image's", recorded == expected,
                     f"expected {expected}, got {recorded}")
        files = sorted(f for f in os.listdir(capture_dir) if f.endswith(".pcapng")) if os.path.isdir(capture_dir) else []
        checks.check("the capture directory has one recording of the disk", len(files) == 1, files)
        if len(files) != 1:
            raise RuntimeError(f"no single recording in {capture_dir}: {files}")
        recording = os.path.join(capture_dir, files[0])
        replayed, server_log = run_phase(
            "strict", ["--virtual", f"replay={recording},mode=strict,report={report_path}"], work, checks)
        checks.check("replay through the bridge: the files' SHA-256 are the recorded ones",
                     replayed == recorded and len(replayed) == len(disk.FILES),
                     f"recorded {recorded}, replayed {replayed}")
        text = open(report_path).read() if os.path.exists(report_path) else ""
        print(f"strict replay report:\n{text}", flush=True)
        report = json.loads(text) if text else {}
        checks.check("the replay report has 0 divergences", report.get("divergences") == 0,
                     json.dumps(report.get("first_divergences"), indent=1))
        checks.check("the replay reached the recording's end (never_asked 0)", report.get("never_asked") == 0,
                     json.dumps(report.get("first_never_asked"), indent=1))
        log = open(server_log, errors="replace").read()
        checks.check("the replay server logs `replay ended as recorded`", "replay ended as recorded" in log,
                     log[-3000:])
    except Exception as error:  # noqa: BLE001 - a wait that timed out is a failure with a reason
        checks.check("the test ran to the end", False, error)
    print(f"test ran {time.time() - started:.1f} s; logs: {guest.LOGS}/replay-redir.*", flush=True)
    checks.exit()


if __name__ == "__main__":
    main()
