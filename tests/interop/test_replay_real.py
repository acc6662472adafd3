#!/usr/bin/env python3
"""A real USB flash drive recorded once and replayed to the real kernel's usb-storage, with no
drive behind the replay.

An exporter guest has QEMU's `usb-storage` on xHCI, removable as flash drives are (a 16 MiB
ext4 image made on the host with three files), and runs `usbwire serve --bind 46f4:0001
--capture DIR`, which exports the drive through usbfs and records every URB of the import. A
vhci-hcd guest attaches it, mounts it read-only, hashes the files, unmounts and detaches
(test_replay_disk.py's `phase`). The exporter then stops that server and serves the recording
with `--virtual replay=CAPTURE,mode=strict` on the same port; the same vhci guest runs the same
workload against it, polling the medium every 500 ms and holding the disk 2 s longer, as a
replay on a machine with udev would.

Checked: the disk appears and mounts in both phases; the files' SHA-256 are the image's from
the drive and the same from the replay; the replay's report has 0 divergences, nothing of the
recording unasked, and the block layer's polls answered (`ready_checks_answered` > 0); the
replay server logs `replay ended as recorded`; dmesg has no `given back`, I/O error or reset.
About 30 seconds.

Run: python3 tests/interop/test_replay_real.py   (USBWIRE_BIN=path/to/usbwire)
"""

import hashlib
import json
import os
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import guest  # noqa: E402
import test_replay_disk as disk  # noqa: E402
from test_wan_storage_real import exported_flash_drive  # noqa: E402

BIN = guest.BIN

EXPORTER_SCRIPT = r"""
set -u
# until_host PORT: waits until the host listens on PORT (it says a step is done).
until_host() { i=0; while [ $i -lt 2400 ]; do nc -w 1 10.0.2.2 $1 </dev/null >/dev/null 2>&1 && return 0; sleep 0.5; i=$((i+1)); done; return 1; }
mkdir -m 700 /tmp/capture
usbwire serve -v --listen 0.0.0.0:3240 --no-advertise --bind 46f4:0001 --capture /tmp/capture > /tmp/record.log 2>&1 &
RECORDER=$!
echo "@@SERVER-UP"
until_host __RECORDED__
kill $RECORDER; wait $RECORDER
CAPTURE=$(ls /tmp/capture/*.pcapng | head -n 1)
echo "@@CAPTURE $CAPTURE $(wc -c < $CAPTURE) bytes, $(ls /tmp/capture | wc -l) file(s)"
usbwire serve -v --listen 0.0.0.0:3240 --no-advertise --control /tmp/replay.sock \
  --virtual "replay=$CAPTURE,mode=strict,report=/tmp/strict.json" > /tmp/replay.log 2>&1 &
REPLAY=$!
echo "@@REPLAY-UP"
until_host __DONE__
kill $REPLAY; wait $REPLAY
echo "@@REPORT-BEGIN"; cat /tmp/strict.json; echo; echo "@@REPORT-END"
echo "@@REPLAY-LOG-BEGIN"; cat /tmp/replay.log; echo "@@REPLAY-LOG-END"
exit 0
"""

VHCI_SCRIPT = disk.GUEST_SCRIPT.replace("__ACCELERATE__", "--accelerate off").replace("__FILES__", " ".join(disk.FILES))


class Signal:
    """A port the host listens on once a step is done: the exporter's `until_host` returns."""

    def __init__(self):
        self.port = guest.free_port()
        self.sock = socket.socket()

    def give(self):
        self.sock.bind(("127.0.0.1", self.port))
        self.sock.listen(4)

        def hang_up():
            try:
                while True:
                    conn, _ = self.sock.accept()
                    conn.close()
            except OSError:
                pass

        threading.Thread(target=hang_up, daemon=True).start()

    def close(self):
        self.sock.close()


def main():
    guest.require(BIN)
    guest.build()
    checks = guest.Checks()
    work = guest.scratch("usbwire-replay-real-")
    image = disk.make_image(work)
    expected = {name: hashlib.sha256(data).hexdigest() for name, data in disk.FILES.items()}
    port = guest.free_port()
    recorded_signal, done_signal = Signal(), Signal()
    exporter = vhci = None
    started = time.time()
    try:
        script = EXPORTER_SCRIPT.replace("__RECORDED__", str(recorded_signal.port)).replace(
            "__DONE__", str(done_signal.port))
        exporter = guest.Guest(
            "replay-real-exporter", script, files={BIN: "/usr/bin/usbwire"}, hostfwd={3240: port}, timeout=900,
            qemu_args=["-device", "qemu-xhci,id=xhci", "-drive", f"if=none,id=flash,format=raw,file={image}",
                       "-device", "usb-storage,bus=xhci.0,drive=flash,removable=on"])
        exporter.wait_for("@@SERVER-UP", 180)
        busid = exported_flash_drive(port, exporter)
        print(f"the exporter lists the flash drive as {busid}", flush=True)
        phases = f"phase record {port} {busid}\nphase strict {port} 0-1"
        vhci = guest.Guest("replay-real-vhci", VHCI_SCRIPT.replace("__PHASES__", phases),
                           files={BIN: "/usr/bin/usbwire"}, timeout=900)
        vhci.wait_for("@@BOOTED", 180)

        recorded = disk.run_phase(vhci, checks, "record")
        checks.check("record: the files' SHA-256 from the drive are the image's", recorded == expected,
                     f"expected {expected}, got {recorded}")
        recorded_signal.give()
        print(exporter.wait_for("@@CAPTURE", 120), flush=True)
        exporter.wait_for("@@REPLAY-UP", 60)

        replayed = disk.run_phase(vhci, checks, "strict")
        checks.check("strict replay: the files' SHA-256 are the recorded ones",
                     replayed == recorded and len(replayed) == len(disk.FILES),
                     f"recorded {recorded}, replayed {replayed}")
        dmesg = vhci.collect("@@DMESG-BEGIN", "@@DMESG-END", 60)
        print(f"vhci guest dmesg (USB and disk lines):\n{dmesg}", flush=True)
        checks.check("no 'already given back' in dmesg", "given back" not in dmesg, dmesg)
        checks.check("no I/O error or reset in dmesg",
                     not any(w in dmesg.lower() for w in ("i/o error", "reset high-speed", "reset super")), dmesg)
        checks.check("vhci guest script exit code", vhci.finish(60) == 0)

        done_signal.give()
        text = exporter.collect("@@REPORT-BEGIN", "@@REPORT-END", 120)
        print(f"strict replay report:\n{text}", flush=True)
        report = json.loads(text) if text.strip() else None
        checks.check("the replay wrote its report", report is not None, text)
        if report is not None:
            checks.check("the replay report has 0 divergences", report.get("divergences") == 0,
                         json.dumps(report.get("first_divergences"), indent=1))
            checks.check("the replay reached the recording's end (never_asked 0)", report.get("never_asked") == 0,
                         json.dumps(report.get("first_never_asked"), indent=1))
            checks.check("the replay answered the block layer's media polls (ready_checks_answered > 0)",
                         report.get("ready_checks_answered", 0) > 0, str(report.get("ready_checks_answered")))
        log = exporter.collect("@@REPLAY-LOG-BEGIN", "@@REPLAY-LOG-END", 60)
        checks.check("the replay server logs `replay ended as recorded`", "replay ended as recorded" in log,
                     log[-3000:])
        checks.check("exporter guest exit code", exporter.finish(60) == 0)
    except Exception as error:  # noqa: BLE001 - a wait that timed out is a failure with a reason
        checks.check("the test ran to the end", False, error)
    finally:
        recorded_signal.close()
        done_signal.close()
        for g in (vhci, exporter):
            if g:
                g.kill()
    print(f"test ran {time.time() - started:.1f} s; logs: {guest.LOGS}/replay-real-*.console.log", flush=True)
    checks.exit()


if __name__ == "__main__":
    main()
