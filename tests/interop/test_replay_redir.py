#!/usr/bin/env python3
"""A disk, a keyboard and a serial port recorded once and replayed to a VM's own drivers through
the usbredir bridge: no usbip in the guest, no device behind the replay.

Recording: `usbwire serve --virtual disk=IMAGE --virtual keyboard --virtual serial=LINK
--capture DIR` (an ext4 image made on the host with test_replay_disk.py's files), one `usbwire
redir` bridge per device importing it and listening on a Unix socket, and a guest (Debian's
kernel under TCG) whose QEMU has a `usb-redir` device dialling each socket. The guest's kernel
finds the devices at boot: it mounts the disk read-only, hashes the files and unmounts; reads
the keyboard's input events while the host types (`usbwire type`); sends a line through the
serial port (cdc_acm) and reads the host's answer from the pty. The bridges are stopped (the
imports end) and the server with them. Replay: the same with `--virtual
replay=CAPTURE,mode=strict` for each device (the keyboard's and serial port's
`timing=recorded`) behind new bridges and a fresh guest, nobody typing or answering.

Checked: the guest mounts the disk in both; the files' SHA-256 are the image's in the recording
and the same in the replay; the typed word's key presses and the serial answer are the same in
both; each replay's report has 0 divergences, and the disk's nothing of the recording unasked;
the replay server logs `replay ended as recorded` for each; dmesg has no I/O error or reset.
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
from test_core_server import GUEST_SERIAL_PING, KEYCODES, serial_ping_pong  # noqa: E402
from test_replay_kernel import events, listening, presses  # noqa: E402

BIN = guest.BIN
WORD = "redir7"
# The recorded devices, in the order the servers list them (0-1, 0-2, 0-3).
DEVICES = ["disk", "keyboard", "serial"]

GUEST_SCRIPT = r"""
set -u
wait_for '[ -e /sys/block/sda ] && [ -e /dev/sda ] && [ "$(cat /sys/block/sda/size)" != 0 ]' 600; check disk $?
mount -t ext4 -o ro /dev/sda /mnt > /tmp/mount.out 2>&1; check mount $? "$(cat /tmp/mount.out)"
echo "@@SHA-BEGIN"; (cd /mnt && sha256sum __FILES__); echo "@@SHA-END"
umount /mnt; check umount $?
kbd() { grep -q "usbwire keyboard" /proc/bus/input/devices; }
wait_for kbd 600; check keyboard $?
EV=$(awk '/usbwire keyboard/ {f=1} f && /Handlers=/ {for (i=1;i<=NF;i++) if ($i ~ /^event/) {print $i; exit}}' /proc/bus/input/devices)
(timeout 14 cat /dev/input/$EV > /tmp/events) &
sleep 3
echo "@@READY-FOR-TYPE"
wait
echo "@@EVENTS-BEGIN"; od -A n -t x1 -v /tmp/events; echo "@@EVENTS-END"
wait_path /dev/ttyACM0 600; check serial $?
__SERIAL_PING__
echo "@@SERIAL-ANSWER $(cat /tmp/serial-in)"
echo "@@DMESG-BEGIN"
dmesg | grep -iE "usb [0-9]-|usb-storage|scsi|sd |sda|EXT4|error|reset"
echo "@@DMESG-END"
exit 0
"""


def run_phase(name, server_args, work, checks, control=None, link=None):
    """One server, a bridge per device, one guest; the host types on the keyboard and answers
    on the serial port's pty `link` when given `control` (the server's control socket). Returns
    what the guest read (the files' SHA-256, the key presses, the serial answer) and the
    server's log path (the server and bridges are stopped on return: the imports have ended)."""
    port = guest.free_port()
    server_log = os.path.join(guest.LOGS, f"replay-redir.{name}.server.log")
    processes = []
    g = None
    got = {}
    try:
        with open(server_log, "w") as out:
            processes.append(subprocess.Popen(
                [BIN, "serve", "-v", "--listen", f"127.0.0.1:{port}", "--no-advertise",
                 "--control", control or os.path.join(work, f"{name}.sock")] + server_args,
                stdout=out, stderr=subprocess.STDOUT))
        checks.check(f"{name}: the server listens", listening(port, processes[0]), server_log)
        qemu_args = ["-device", "qemu-xhci,id=xhci"]
        for number, device in enumerate(DEVICES, start=1):
            socket_path = os.path.join(work, f"{name}-{device}.redir.sock")
            with open(os.path.join(guest.LOGS, f"replay-redir.{name}.bridge-{device}.log"), "w") as out:
                bridge, redir_args = guest.redir_bridge(port, f"0-{number}", socket_path, out, wait=30, tag=device)
            processes.append(bridge)
            qemu_args += redir_args
            checks.check(f"{name}: the {device}'s bridge listens", os.path.exists(socket_path), socket_path)
        script = (GUEST_SCRIPT.replace("__FILES__", " ".join(disk.FILES))
                  .replace("__SERIAL_PING__\n", GUEST_SERIAL_PING))
        g = guest.Guest(f"replay-redir-{name}", script, timeout=600, qemu_args=qemu_args)
        g.wait_for("@@BOOTED", 180)
        for step in ["disk", "mount"]:
            line = g.wait_for(f"@@CHECK {step} ", 300)
            checks.check(f"{name} guest: {step}", " PASS" in line, line)
        got["files"] = disk.hashes(g.collect("@@SHA-BEGIN", "@@SHA-END", 180))
        line = g.wait_for("@@CHECK umount ", 120)
        checks.check(f"{name} guest: umount", " PASS" in line, line)
        line = g.wait_for("@@CHECK keyboard ", 300)
        checks.check(f"{name} guest: keyboard", " PASS" in line, line)
        g.wait_for("@@READY-FOR-TYPE", 60)
        if control:
            for _ in range(50):
                typed = subprocess.run([BIN, "type", "--control", control, WORD], capture_output=True, text=True)
                if typed.returncode == 0:
                    break
                time.sleep(0.1)
            checks.check(f"{name}: usbwire type accepted the text", typed.returncode == 0, typed.stderr)
        keys, _ = events(g.collect("@@EVENTS-BEGIN", "@@EVENTS-END", 90).splitlines())
        got["keys"] = presses(keys)
        line = g.wait_for("@@CHECK serial ", 300)
        checks.check(f"{name} guest: serial", " PASS" in line, line)
        if link:
            serial_ping_pong(g, checks, link)
        got["serial"] = g.wait_for("@@SERIAL-ANSWER", 60).split("@@SERIAL-ANSWER", 1)[1].strip()
        dmesg = g.collect("@@DMESG-BEGIN", "@@DMESG-END", 60)
        checks.check(f"{name}: no I/O error or reset in the guest's dmesg",
                     not any(w in dmesg.lower() for w in ("i/o error", "reset high-speed", "reset super")), dmesg)
        checks.check(f"{name}: guest script exit code", g.finish(60) == 0)
    finally:
        if g:
            g.kill()
        # The bridges first: their imports end, and the server writes what it owes (captures, reports).
        guest.stop(processes[1:])
        guest.stop(processes[:1])
    print(f"{name}: read {got}", flush=True)
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
    link = os.path.join(work, "ttyUSBWIRE")
    reports = {device: os.path.join(work, f"{device}.report.json") for device in DEVICES}
    started = time.time()
    try:
        recorded, _ = run_phase(
            "record", ["--capture", capture_dir, "--virtual", f"disk={image},size=16M", "--virtual", "keyboard",
                       "--virtual", f"serial={link}"], work, checks, control=os.path.join(work, "record.sock"),
            link=link)
        checks.check("record: the files' SHA-256 are the image's", recorded.get("files") == expected,
                     f"expected {expected}, got {recorded.get('files')}")
        checks.check("record: the typed word arrives as key presses",
                     recorded.get("keys") == [KEYCODES[c] for c in WORD], recorded.get("keys"))
        checks.check("record: the host's answer came through the serial port",
                     "pong-from-host" in recorded.get("serial", ""), recorded.get("serial"))
        files = sorted(os.listdir(capture_dir)) if os.path.isdir(capture_dir) else []
        # One recording per import, named for its bus id: 0-1 the disk, 0-2 the keyboard, 0-3 the serial port.
        recordings = {device: [f for f in files if f.startswith(f"usbwire-0-{n}-")] for n, device in
                      enumerate(DEVICES, start=1)}
        checks.check("the capture directory has one recording of each device",
                     all(len(found) == 1 for found in recordings.values()), files)
        if not all(len(found) == 1 for found in recordings.values()):
            raise RuntimeError(f"not one recording per device in {capture_dir}: {files}")
        replays = []
        for device in DEVICES:
            timing = "" if device == "disk" else ",timing=recorded"
            path = os.path.join(capture_dir, recordings[device][0])
            replays += ["--virtual", f"replay={path},mode=strict{timing},report={reports[device]}"]
        replayed, server_log = run_phase("strict", replays, work, checks)
        checks.check("replay through the bridge: the files' SHA-256 are the recorded ones",
                     replayed.get("files") == recorded.get("files") and len(replayed.get("files", {})) == len(disk.FILES),
                     f"recorded {recorded.get('files')}, replayed {replayed.get('files')}")
        checks.check("replay through the bridge: the same key presses, nobody typing",
                     replayed.get("keys") == recorded.get("keys"), replayed.get("keys"))
        checks.check("replay through the bridge: the same serial answer, nobody on the pty",
                     replayed.get("serial") == recorded.get("serial"), replayed.get("serial"))
        for device in DEVICES:
            text = open(reports[device]).read() if os.path.exists(reports[device]) else ""
            print(f"{device} replay report:\n{text}", flush=True)
            report = json.loads(text) if text else {}
            checks.check(f"the {device}'s replay report has 0 divergences", report.get("divergences") == 0,
                         json.dumps(report.get("first_divergences"), indent=1))
            if device == "disk":
                checks.check("the disk's replay reached the recording's end (never_asked 0)",
                             report.get("never_asked") == 0, json.dumps(report.get("first_never_asked"), indent=1))
        log = open(server_log, errors="replace").read()
        checks.check("the replay server logs `replay ended as recorded` for each device",
                     log.count("replay ended as recorded") == len(DEVICES), log[-3000:])
    except Exception as error:  # noqa: BLE001 - a wait that timed out is a failure with a reason
        checks.check("the test ran to the end", False, error)
    print(f"test ran {time.time() - started:.1f} s; logs: {guest.LOGS}/replay-redir.*", flush=True)
    checks.exit()


if __name__ == "__main__":
    main()
