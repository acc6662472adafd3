#!/usr/bin/env python3
"""A real USB flash drive, keyboard and serial adapter recorded once and replayed to the real
kernel's usb-storage, usbhid and ftdi_sio, with no device behind the replay.

An exporter guest has QEMU's `usb-storage` on xHCI, removable as flash drives are (a 16 MiB
ext4 image made on the host with three files), and runs `usbwire serve --bind 46f4:0001
--capture DIR`, which exports the drive through usbfs and records every URB of the import. A
vhci-hcd guest attaches it, mounts it read-only, hashes the files, unmounts and detaches
(test_replay_disk.py's `phase`). The exporter then stops that server and serves the recording
with `--virtual replay=CAPTURE,mode=strict` on the same port; the same vhci guest runs the same
workload against it, polling the medium every 500 ms and holding the disk 2 s longer, as a
replay on a machine with udev would. The exporter's QEMU also has a `usb-kbd`, exported the same
way: the vhci guest reads its input events while the host types "usb" on it (QEMU's `sendkey`),
and the replay (`timing=recorded`, nobody typing) gives the same key presses. Its `usb-serial`
(an FTDI adapter, its chardev a socket the host answers on) carries a line from the guest and the
host's answer back; the replay gives the guest the same answer with nobody on the host. The same
recording replayed to other workloads reports the first divergent request: at 9600 baud instead
of 115200, strict mode stalls ftdi_sio's baud rate request (recorded once, at open, and now
asked again); with another line sent, lenient mode answers the differing OUT from the recording
and goes on to give the guest the recorded answer.

Checked: the disk appears and mounts in both phases; the files' SHA-256 are the image's from
the drive and the same from the replay; the replay's report has 0 divergences, nothing of the
recording unasked, and the block layer's polls answered (`ready_checks_answered` > 0); the
replay server logs `replay ended as recorded` for each; the keyboard's presses are KEY_U, KEY_S,
KEY_B when typed and when replayed; the serial adapter's line reaches the host and the answer the
guest, recorded and replayed; each replay report has 0 divergences; dmesg has no `given back`,
I/O error or reset.
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
import test_replay_kernel as replay_kernel  # noqa: E402
from test_real_devices import qemu_monitor  # noqa: E402
from test_wan_storage_real import exported_flash_drive  # noqa: E402

BIN = guest.BIN

EXPORTER_SCRIPT = r"""
set -u
# until_host PORT: waits until the host listens on PORT (it says a step is done).
until_host() { i=0; while [ $i -lt 2400 ]; do nc -w 1 10.0.2.2 $1 </dev/null >/dev/null 2>&1 && return 0; sleep 0.5; i=$((i+1)); done; return 1; }
mkdir -m 700 /tmp/capture
usbwire serve -v --listen 0.0.0.0:3240 --no-advertise --bind 46f4:0001 --bind 0627:0001 --bind 0403:6001 \
  --capture /tmp/capture > /tmp/record.log 2>&1 &
RECORDER=$!
echo "@@SERVER-UP"
until_host __RECORDED__
kill $RECORDER; wait $RECORDER
# Each capture is named for the bus id it recorded: which is the drive, which the keyboard.
for f in /tmp/capture/*.pcapng; do
  busid=$(basename $f | sed 's/^usbwire-\([0-9]*-[0-9.]*\)-.*/\1/')
  case $(cat /sys/bus/usb/devices/$busid/idVendor) in 46f4) DRIVE=$f ;; 0627) KEYBOARD=$f ;; 0403) SERIAL=$f ;; esac
  echo "@@CAPTURE $f $(wc -c < $f) bytes"
done
usbwire serve -v --listen 0.0.0.0:3240 --no-advertise --control /tmp/replay.sock \
  --virtual "replay=$DRIVE,mode=strict,report=/tmp/strict.json" \
  --virtual "replay=$KEYBOARD,mode=strict,timing=recorded,report=/tmp/keyboard.json" \
  --virtual "replay=$SERIAL,mode=strict,timing=recorded,report=/tmp/serial.json" \
  --virtual "replay=$SERIAL,mode=strict,timing=recorded,report=/tmp/serial-9600-strict.json" \
  --virtual "replay=$SERIAL,mode=lenient,timing=recorded,report=/tmp/serial-other-line-lenient.json" \
  > /tmp/replay.log 2>&1 &
REPLAY=$!
echo "@@REPLAY-UP"
until_host __DONE__
kill $REPLAY; wait $REPLAY
echo "@@REPORT-BEGIN"; cat /tmp/strict.json; echo; echo "@@REPORT-END"
echo "@@KEYBOARD-REPORT-BEGIN"; cat /tmp/keyboard.json; echo; echo "@@KEYBOARD-REPORT-END"
for r in serial serial-9600-strict serial-other-line-lenient; do
  echo "@@$r-REPORT-BEGIN"; cat /tmp/$r.json; echo; echo "@@$r-REPORT-END"
done
echo "@@REPLAY-LOG-BEGIN"; cat /tmp/replay.log; echo "@@REPLAY-LOG-END"
exit 0
"""

KEYBOARD_PHASE = r"""
kbd() { grep -q "QEMU USB Keyboard" /proc/bus/input/devices; }
# keyboard NAME PORT BUSID: import the keyboard, read its input events for a while (the host types
# once READY-FOR-TYPE is out), print them and detach.
keyboard() {
  N=$1; S=10.0.2.2:$2; B=$3
  wait_for "usbwire list -r $S 2>/dev/null | grep -q ' $B: '" 1800; check $N-listed $?
  usbwire attach -r $S -b $B --accelerate off > /tmp/attach.out 2>&1; check $N-attach $? "$(cat /tmp/attach.out)"
  wait_for kbd 300; check $N-input-device $?
  EV=$(awk '/QEMU USB Keyboard/ {f=1} f && /Handlers=/ {for (i=1;i<=NF;i++) if ($i ~ /^event/) {print $i; exit}}' /proc/bus/input/devices)
  (timeout 12 cat /dev/input/$EV > /tmp/$N.events) &
  sleep 3
  echo "@@$N-READY-FOR-TYPE"
  wait
  echo "@@$N-EVENTS-BEGIN"; od -A n -t x1 -v /tmp/$N.events; echo "@@$N-EVENTS-END"
  rc=0
  for p in $(usbwire port --json | tr ',{}' '\n\n\n' | sed -n 's/.*"port":\([0-9]*\).*/\1/p'); do usbwire detach -p $p || rc=1; done
  check $N-detach $rc
  wait_for '! kbd' 300; check $N-gone $?
  echo "@@$N-DETACHED"
}
# serial NAME PORT BUSID [BAUD [LINE]]: import the serial adapter, send LINE (ping-from-guest
# unless named) through it at BAUD (115200 unless named) and read the answer.
serial() {
  N=$1; S=10.0.2.2:$2; B=$3; BAUD=${4:-115200}; LINE=${5:-ping-from-guest}
  wait_for "usbwire list -r $S 2>/dev/null | grep -q ' $B: '" 1800; check $N-listed $?
  usbwire attach -r $S -b $B --accelerate off > /tmp/attach.out 2>&1; check $N-attach $? "$(cat /tmp/attach.out)"
  wait_path /dev/ttyUSB0 300; check $N-tty $?
  stty -F /dev/ttyUSB0 raw -echo $BAUD
  (timeout 20 head -n 1 /dev/ttyUSB0 > /tmp/$N.in) &
  sleep 0.5
  echo "@@$N-READY"
  echo "$LINE" > /dev/ttyUSB0
  wait
  echo "@@$N-IN $(cat /tmp/$N.in)"
  rc=0
  for p in $(usbwire port --json | tr ',{}' '\n\n\n' | sed -n 's/.*"port":\([0-9]*\).*/\1/p'); do usbwire detach -p $p || rc=1; done
  check $N-detach $rc
  wait_for '[ ! -e /dev/ttyUSB0 ]' 300; check $N-gone $?
  echo "@@$N-DETACHED"
}
"""

VHCI_SCRIPT = (disk.GUEST_SCRIPT.replace("__ACCELERATE__", "--accelerate off").replace("__FILES__", " ".join(disk.FILES))
               .replace("__PHASES__", KEYBOARD_PHASE + "__PHASES__"))
# The keys the host types while recording, and the presses they give (KEY_U, KEY_S, KEY_B).
TYPED = "usb"
PRESSES = [22, 31, 48]
# What the host answers on the serial adapter.
ANSWER = "pong-from-host"


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


class HostSerial:
    """The far end of the exporter's serial adapter (QEMU's chardev socket): answers the guest's
    line with ANSWER, and keeps what it got."""

    def __init__(self, path):
        self.path = path
        self.got = b""
        self.sock = socket.socket(socket.AF_UNIX)

    def start(self):
        threading.Thread(target=self.answer, daemon=True).start()

    def answer(self):
        try:
            for _ in range(600):
                if os.path.exists(self.path):
                    break
                time.sleep(0.1)
            self.sock.connect(self.path)
            while b"\n" not in self.got:
                data = self.sock.recv(1024)
                if not data:
                    return
                self.got += data
            self.sock.sendall(ANSWER.encode() + b"\n")
            while self.sock.recv(1024):
                pass
        except OSError:
            pass

    def close(self):
        self.sock.close()


def serial_phase(vhci, checks, name):
    """The vhci guest's `serial NAME`; returns the line it read back."""
    for step in ["listed", "attach", "tty"]:
        line = vhci.wait_for(f"@@CHECK {name}-{step} ", 300)
        checks.check(f"guest: {name}-{step}", " PASS" in line, line)
    line = vhci.wait_for(f"@@{name}-IN", 60)
    for step in ["detach", "gone"]:
        step_line = vhci.wait_for(f"@@CHECK {name}-{step} ", 180)
        checks.check(f"guest: {name}-{step}", " PASS" in step_line, step_line)
    vhci.wait_for(f"@@{name}-DETACHED", 60)
    got = line.split(f"@@{name}-IN", 1)[1].strip()
    print(f"{name}: read {got!r}", flush=True)
    return got


def keyboard_phase(vhci, checks, name, monitor):
    """The vhci guest's `keyboard NAME`: types TYPED on the exporter's keyboard through QEMU's
    monitor when `monitor` is given; returns the key presses the guest read."""
    for step in ["listed", "attach", "input-device"]:
        line = vhci.wait_for(f"@@CHECK {name}-{step} ", 300)
        checks.check(f"guest: {name}-{step}", " PASS" in line, line)
    vhci.wait_for(f"@@{name}-READY-FOR-TYPE", 60)
    if monitor:
        for key in TYPED:
            qemu_monitor(monitor, f"sendkey {key}")
    got, span = replay_kernel.events(vhci.collect(f"@@{name}-EVENTS-BEGIN", f"@@{name}-EVENTS-END", 60).splitlines())
    for step in ["detach", "gone"]:
        line = vhci.wait_for(f"@@CHECK {name}-{step} ", 180)
        checks.check(f"guest: {name}-{step}", " PASS" in line, line)
    vhci.wait_for(f"@@{name}-DETACHED", 60)
    print(f"{name}: {len(got)} key events over {span:.3f} s, presses {replay_kernel.presses(got)}", flush=True)
    return replay_kernel.presses(got)


def main():
    guest.require(BIN)
    guest.build()
    checks = guest.Checks()
    work = guest.scratch("usbwire-replay-real-")
    image = disk.make_image(work)
    expected = {name: hashlib.sha256(data).hexdigest() for name, data in disk.FILES.items()}
    port = guest.free_port()
    monitor = os.path.join(work, "monitor.sock")
    host_serial = HostSerial(os.path.join(work, "serial.sock"))
    recorded_signal, done_signal = Signal(), Signal()
    exporter = vhci = None
    started = time.time()
    try:
        script = EXPORTER_SCRIPT.replace("__RECORDED__", str(recorded_signal.port)).replace(
            "__DONE__", str(done_signal.port))
        exporter = guest.Guest(
            "replay-real-exporter", script, files={BIN: "/usr/bin/usbwire"}, hostfwd={3240: port}, timeout=900,
            qemu_args=["-device", "qemu-xhci,id=xhci", "-drive", f"if=none,id=flash,format=raw,file={image}",
                       "-device", "usb-storage,bus=xhci.0,drive=flash,removable=on",
                       "-device", "usb-kbd,bus=xhci.0", "-monitor", f"unix:{monitor},server=on,wait=off",
                       "-chardev", f"socket,id=ser,path={host_serial.path},server=on,wait=off",
                       "-device", "usb-serial,bus=xhci.0,chardev=ser"])
        # QEMU attaches the adapter once its chardev has a peer.
        host_serial.start()
        exporter.wait_for("@@SERVER-UP", 180)
        busid = exported_flash_drive(port, exporter)
        keyboard = exported_flash_drive(port, exporter, device_id=("0627", "0001"))
        print(f"the exporter lists the flash drive as {busid}, the keyboard as {keyboard}", flush=True)
        adapter = exported_flash_drive(port, exporter, device_id=("0403", "6001"))
        print(f"the serial adapter as {adapter}", flush=True)
        phases = (f"phase record {port} {busid}\nkeyboard kbd-record {port} {keyboard}\n"
                  f"serial ser-record {port} {adapter}\n"
                  f"phase strict {port} 0-1\nkeyboard kbd-replay {port} 0-2\nserial ser-replay {port} 0-3\n"
                  f"serial ser-9600-strict {port} 0-4 9600\nserial ser-other-line-lenient {port} 0-5 115200 hello-there")
        vhci = guest.Guest("replay-real-vhci", VHCI_SCRIPT.replace("__PHASES__", phases),
                           files={BIN: "/usr/bin/usbwire"}, timeout=900)
        vhci.wait_for("@@BOOTED", 180)

        recorded = disk.run_phase(vhci, checks, "record")
        checks.check("record: the files' SHA-256 from the drive are the image's", recorded == expected,
                     f"expected {expected}, got {recorded}")
        typed = keyboard_phase(vhci, checks, "kbd-record", monitor)
        checks.check("record: the keys typed on the real keyboard arrive as presses", typed == PRESSES, typed)
        answer = serial_phase(vhci, checks, "ser-record")
        checks.check("record: the host's answer came through the serial adapter", answer == ANSWER, answer)
        checks.check("record: the guest's line reached the host", b"ping-from-guest" in host_serial.got,
                     repr(host_serial.got))
        recorded_signal.give()
        print(exporter.wait_for("@@CAPTURE", 120), flush=True)
        exporter.wait_for("@@REPLAY-UP", 60)

        replayed = disk.run_phase(vhci, checks, "strict")
        checks.check("strict replay: the files' SHA-256 are the recorded ones",
                     replayed == recorded and len(replayed) == len(disk.FILES),
                     f"recorded {recorded}, replayed {replayed}")
        again = keyboard_phase(vhci, checks, "kbd-replay", None)
        checks.check("replay: the keyboard gives the recorded presses with nobody typing", again == typed, again)
        answer = serial_phase(vhci, checks, "ser-replay")
        checks.check("replay: the serial adapter gives the recorded answer with nobody on the host",
                     answer == ANSWER, answer)
        serial_phase(vhci, checks, "ser-9600-strict")
        lenient_answer = serial_phase(vhci, checks, "ser-other-line-lenient")
        checks.check("lenient replay of another workload: the guest still gets the recorded answer",
                     lenient_answer == ANSWER, lenient_answer)
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
        text = exporter.collect("@@KEYBOARD-REPORT-BEGIN", "@@KEYBOARD-REPORT-END", 60)
        print(f"keyboard replay report:\n{text}", flush=True)
        report = json.loads(text) if text.strip() else {}
        checks.check("the keyboard's replay report has 0 divergences", report.get("divergences") == 0,
                     json.dumps(report.get("first_divergences"), indent=1))
        text = exporter.collect("@@serial-REPORT-BEGIN", "@@serial-REPORT-END", 60)
        print(f"serial adapter replay report:\n{text}", flush=True)
        report = json.loads(text) if text.strip() else {}
        checks.check("the serial adapter's replay report has 0 divergences", report.get("divergences") == 0,
                     json.dumps(report.get("first_divergences"), indent=1))
        # FTDI's SET_BAUDRATE is vendor request 3 to the device (bmRequestType 0x40); the line
        # goes out on the bulk OUT endpoint.
        for workload, start, answered in (("9600-strict", "control 40 03", "stall"),
                                          ("other-line-lenient", "OUT ", "recorded")):
            text = exporter.collect(f"@@serial-{workload}-REPORT-BEGIN", f"@@serial-{workload}-REPORT-END", 60)
            report = json.loads(text) if text.strip() else {}
            first = (report.get("first_divergences") or [{}])[0]
            print(f"serial {workload}: {report.get('divergences')} divergence(s), first {json.dumps(first)}",
                  flush=True)
            checks.check(f"serial {workload}: the first divergence is `{start}…`, answered {answered}",
                         first.get("request", "").startswith(start) and first.get("answered") == answered,
                         json.dumps(report, indent=1)[-2000:])
        log = exporter.collect("@@REPLAY-LOG-BEGIN", "@@REPLAY-LOG-END", 60)
        checks.check("the replay server logs `replay ended as recorded` for each device",
                     log.count("replay ended as recorded") == 3, log[-3000:])
        checks.check("exporter guest exit code", exporter.finish(60) == 0)
    except Exception as error:  # noqa: BLE001 - a wait that timed out is a failure with a reason
        checks.check("the test ran to the end", False, error)
    finally:
        recorded_signal.close()
        done_signal.close()
        host_serial.close()
        for g in (vhci, exporter):
            if g:
                g.kill()
    print(f"test ran {time.time() - started:.1f} s; logs: {guest.LOGS}/replay-real-*.console.log", flush=True)
    checks.exit()


if __name__ == "__main__":
    main()
