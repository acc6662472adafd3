#!/usr/bin/env python3
"""Record devices once, replay them to real kernel drivers: a vhci-hcd guest (Debian's kernel
under QEMU) imports `usbwire serve --virtual keyboard --virtual serial=LINK` with `--capture` on
the host. usbhid binds the keyboard and the guest reads its raw input events while the host types
a word (`usbwire type`); cdc_acm binds the serial port, the guest writes a line to /dev/ttyACM0
and reads the line the host answers on the pty. The server stops, and `usbwire serve --virtual
replay=CAPTURE,timing=recorded,report=JSON` serves each recording back twice: the same guest
attaches the first replays the same way and runs the same workload, with nobody typing or
answering on the host; then the second replays with Debian's `usbip attach` instead.

Checked: both devices enumerate and their drivers bind in both phases; the key events (type,
code, value, without the timestamps) are the same in both, not empty, and press the typed word's
keys; the bytes the guest reads from ttyACM0 are the same in both; each replay's report has 0
divergences (with either client) (printed whole, with what diverged if anything did) and the server logs `replay
ended as recorded` for each; dmesg has no `given back` or short HID report.

Run: python3 tests/interop/test_replay_kernel.py   (USBWIRE_BIN=path/to/usbwire)
"""

import json
import os
import re
import struct
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import guest  # noqa: E402
from test_core_server import GUEST_SERIAL_PING, KEYCODES, serial_ping_pong  # noqa: E402

BIN = guest.BIN
WORD = "replay42"
# How long the guest reads events, and how long it waits after opening the event device before
# the host types. The kernel's console keyboard handler opens the input device at bind, so
# usbhid's interrupt URB is pending from then on: with `timing=asap` the replay would give it
# the keys at once and they would reach only that handler, before the guest's `cat` opens the
# event device. `timing=recorded` gives each report the time the recorded one took from its
# URB's submission; LEAD is the margin for the guest reaching its `cat` later in the replay than
# it did while recording. (The serial port's answer comes the same way, the recorded time after
# the read URB of the guest's `head`.)
READ_SECONDS = 14
LEAD_SECONDS = 3
# The devices in the order the servers list them (bus ids 0-1, 0-2), recorded and replayed.
DEVICES = ["keyboard", "serial"]
# The replay phases: the recordings imported by `usbwire attach`, then by Debian's `usbip attach`.
REPLAYS = ["replay", "stock"]

GUEST_SCRIPT = r"""
set -u
kbd() { grep -q "usbwire keyboard" /proc/bus/input/devices; }
bound() { ls /sys/bus/usb/drivers/$1 2>/dev/null | grep -q ':'; }
# phase NAME PORT KEYBOARD SERIAL ATTACH...: import the keyboard and the serial port (bus ids
# KEYBOARD, SERIAL) of the server at PORT with ATTACH (a command taking -b BUSID), read the
# keyboard's events for a while, a line through the serial port, and detach both.
phase() {
  N=$1; S=10.0.2.2:$2; KB=$3; SER=$4; shift 4
  wait_for "usbwire list -r $S 2>/dev/null | grep -q ' $SER: '" 1800; check $N-listed $?
  "$@" -b $KB > /tmp/attach.out 2>&1; check $N-keyboard-attach $? "$(cat /tmp/attach.out)"
  wait_for kbd 300; check $N-keyboard-input-device $?
  wait_for "bound usbhid" 100; check $N-keyboard-usbhid-bound $?
  EV=$(awk '/usbwire keyboard/ {f=1} f && /Handlers=/ {for (i=1;i<=NF;i++) if ($i ~ /^event/) {print $i; exit}}' /proc/bus/input/devices)
  echo "@@$N-KEYBOARD usbhid: $(ls /sys/bus/usb/drivers/usbhid | grep ':' | tr '\n' ' ')$EV"
  (timeout __READ__ cat /dev/input/$EV > /tmp/$N.events) &
  sleep __LEAD__
  echo "@@$N-READY-FOR-TYPE"
  wait
  echo "@@$N-EVENTS-BEGIN"; od -A n -t x1 -v /tmp/$N.events; echo "@@$N-EVENTS-END"
  "$@" -b $SER > /tmp/attach.out 2>&1; check $N-serial-attach $? "$(cat /tmp/attach.out)"
  wait_path /dev/ttyACM0; check $N-serial-tty $?
  wait_for "bound cdc_acm" 100; check $N-serial-cdc_acm-bound $?
  echo "@@$N-SERIAL cdc_acm: $(ls /sys/bus/usb/drivers/cdc_acm | grep ':' | tr '\n' ' ')"
__SERIAL_PING__
  echo "@@$N-SERIAL-BYTES $(od -A n -t x1 -v /tmp/serial-in | tr -s ' \n' '  ')"
  rc=0
  for p in $(usbwire port --json | tr ',{}' '\n\n\n' | sed -n 's/.*"port":\([0-9]*\).*/\1/p'); do usbwire detach -p $p || rc=1; done
  check $N-detach $rc
  wait_for '! kbd && [ ! -e /dev/ttyACM0 ]' 300; check $N-devices-gone $?
  echo "@@$N-DETACHED"
}
phase record __PORT1__ 0-1 0-2 usbwire attach -r 10.0.2.2:__PORT1__
phase replay __PORT2__ 0-1 0-2 usbwire attach -r 10.0.2.2:__PORT2__
phase stock __PORT2__ 0-3 0-4 usbip --tcp-port __PORT2__ attach -r 10.0.2.2
echo "@@DMESG-BEGIN"
dmesg | grep -iE "vhci_hcd.0: (devid|Device)|vhci_hcd: disconnect|usb 1-|input: usbwire|hid-generic|cdc_acm|given back|too short|error|reset"
echo "@@DMESG-END"
exit 0
"""


def events(hex_lines):
    """The (type, code, value) of each struct input_event (24 bytes on x86_64: the time, then
    u16 type, u16 code, s32 value), and how long after the first the last one came (s)."""
    data = bytes(int(b, 16) for line in hex_lines for b in line.split() if re.fullmatch(r"[0-9a-f]{2}", b))
    at = range(0, len(data) - 23, 24)
    times = [sec + usec / 1e6 for sec, usec in (struct.unpack_from("<qq", data, i) for i in at)]
    return [struct.unpack_from("<HHi", data, i + 16) for i in at], (times[-1] - times[0] if times else 0.0)


def presses(triples):
    return [code for ev_type, code, value in triples if ev_type == 1 and value == 1]


def listening(port, server, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline and server.poll() is None:
        if subprocess.run([BIN, "list", "-r", f"127.0.0.1:{port}"], capture_output=True).returncode == 0:
            return True
        time.sleep(0.1)
    return False


def check_reports(checks, phase, paths):
    """Each device's replay report (written when its import ends, at the detach) has 0
    divergences and answered the kernel from the recording."""
    deadline = time.time() + 30
    while not all(os.path.exists(p) for p in paths.values()) and time.time() < deadline:
        time.sleep(0.2)
    for name, path in paths.items():
        report = None
        if os.path.exists(path):
            text = open(path).read()
            print(f"{phase}: replay report of the {name}:\n{text}", flush=True)
            report = json.loads(text)
        checks.check(f"{phase}: the {name}'s replay wrote its report", report is not None, path)
        if report is not None:
            checks.check(f"{phase}: the {name}'s replay report has 0 divergences", report.get("divergences") == 0,
                         json.dumps(report.get("first_divergences"), indent=1))
            checks.check(f"{phase}: the {name}'s replay answered the kernel's requests from the recording",
                         report.get("requests", 0) > 0 and report.get("matched", 0) > 0,
                         f"requests {report.get('requests')}, matched {report.get('matched')}")


def replay_lines(log_path, who):
    """The replay server's end-of-import lines (`replay ended as recorded` or `replay diverged`)
    in its log, printed under `who`, and the log's text."""
    log_text = open(log_path, errors="replace").read()
    ended = [line for line in log_text.splitlines() if "replay ended as recorded" in line or "replay diverged" in line]
    print(f"{who}:\n" + ("\n".join(ended) or "(no replay line)"), flush=True)
    return ended, log_text


def main():
    guest.require(BIN)
    guest.build()
    checks = guest.Checks()
    work = guest.scratch("usbwire-replay-kernel-")
    port1 = guest.free_port()
    port2 = guest.free_port()
    while port2 == port1:
        port2 = guest.free_port()
    capture_dir = os.path.join(work, "capture")
    link = os.path.join(work, "ttyUSBWIRE")
    control = os.path.join(work, "record.sock")
    # Each recording is served twice: for `usbwire attach` (replay) and for `usbip attach` (stock).
    reports = {(phase, name): os.path.join(work, f"{phase}-{name}.report.json")
               for phase in REPLAYS for name in DEVICES}
    log_paths = {phase: os.path.join(guest.LOGS, f"replay-kernel.{phase}.log") for phase in ("record", "replay")}
    logs = {phase: open(path, "w") for phase, path in log_paths.items()}
    servers = [subprocess.Popen(
        [BIN, "serve", "-v", "--listen", f"127.0.0.1:{port1}", "--no-advertise", "--control", control,
         "--capture", capture_dir, "--virtual", "keyboard", "--virtual", f"serial={link}"],
        stdout=logs["record"], stderr=subprocess.STDOUT)]
    g = None
    started = time.time()
    try:
        checks.check("the recording server listens", listening(port1, servers[0]), log_paths["record"])
        script = (GUEST_SCRIPT.replace("__PORT1__", str(port1)).replace("__PORT2__", str(port2))
                  .replace("__READ__", str(READ_SECONDS)).replace("__LEAD__", str(LEAD_SECONDS))
                  .replace("__SERIAL_PING__\n", GUEST_SERIAL_PING))
        g = guest.Guest("replay-kernel", script, files={BIN: "/usr/bin/usbwire"}, timeout=600)
        g.wait_for("@@BOOTED", 180)
        print(f"guest booted in {time.time() - g.started:.1f} s", flush=True)

        def guest_check(name, timeout=120):
            line = g.wait_for(f"@@CHECK {name} ", timeout)
            checks.check(f"guest: {name}", " PASS" in line, line)

        def run_phase(name, recording):
            """The guest's workload against one server; the host types and answers when `recording`.
            Returns the key events, their span and the bytes read from ttyACM0."""
            for step in ["listed", "keyboard-attach", "keyboard-input-device", "keyboard-usbhid-bound"]:
                guest_check(f"{name}-{step}", 180)
            print(g.wait_for(f"@@{name}-KEYBOARD", 30), flush=True)
            g.wait_for(f"@@{name}-READY-FOR-TYPE", 60)
            if recording:
                typed = None
                for _ in range(50):
                    typed = subprocess.run([BIN, "type", "--control", control, WORD], capture_output=True, text=True)
                    if typed.returncode == 0:
                        break
                    time.sleep(0.1)
                checks.check("usbwire type accepted the text", typed.returncode == 0, typed.stderr)
            got, span = events(g.collect(f"@@{name}-EVENTS-BEGIN", f"@@{name}-EVENTS-END", READ_SECONDS + 60).splitlines())
            for step in ["serial-attach", "serial-tty", "serial-cdc_acm-bound"]:
                guest_check(f"{name}-{step}", 120)
            print(g.wait_for(f"@@{name}-SERIAL", 30), flush=True)
            if recording:
                serial_ping_pong(g, checks, link)
            serial_in = g.wait_for(f"@@{name}-SERIAL-BYTES", 60).split("-SERIAL-BYTES", 1)[1].strip()
            for step in ["detach", "devices-gone"]:
                guest_check(f"{name}-{step}", 90)
            g.wait_for(f"@@{name}-DETACHED", 30)
            print(f"{name}: {len(got)} key events over {span:.3f} s, presses {presses(got)}; "
                  f"ttyACM0 read: {serial_in}", flush=True)
            return got, serial_in

        # Phase 1: record both devices while the kernel's drivers use them.
        recorded, recorded_serial = run_phase("record", True)
        expected = [KEYCODES[c] for c in WORD]
        checks.check("record: the typed word arrives as key presses", presses(recorded) == expected,
                     f"expected {expected}, got {presses(recorded)}")
        # A capture is complete once the server has stopped.
        guest.stop(servers)
        servers = []
        files = sorted(os.listdir(capture_dir)) if os.path.isdir(capture_dir) else []
        recordings = {}
        for busid, name in enumerate(DEVICES, 1):
            mine = [f for f in files if f.startswith(f"usbwire-0-{busid}-") and f.endswith(".pcapng")]
            checks.check(f"the capture directory has one recording of the {name}", len(mine) == 1, files)
            if mine:
                recordings[name] = os.path.join(capture_dir, mine[0])
                print(f"recording of the {name}: {mine[0]}, {os.path.getsize(recordings[name])} bytes", flush=True)
        if len(recordings) != len(DEVICES):
            raise RuntimeError(f"recordings missing in {capture_dir}: {files}")

        # Phase 2: the recordings served back; nobody types or answers.
        command = [BIN, "serve", "-v", "--listen", f"127.0.0.1:{port2}", "--no-advertise",
                   "--control", os.path.join(work, "replay.sock")]
        for phase in REPLAYS:
            for name in DEVICES:
                command += ["--virtual", f"replay={recordings[name]},timing=recorded,report={reports[phase, name]}"]
        servers = [subprocess.Popen(command, stdout=logs["replay"], stderr=subprocess.STDOUT)]
        checks.check("the replay server listens", listening(port2, servers[0]), log_paths["replay"])
        for phase in REPLAYS:
            replayed, replayed_serial = run_phase(phase, False)
            checks.check(f"{phase}: the typed word's key presses arrive", presses(replayed) == expected,
                         f"expected {expected}, got {presses(replayed)}")
            checks.check(f"{phase}: the key events (type, code, value) are the recorded ones",
                         len(replayed) > 0 and replayed == recorded, f"\nrecorded {recorded}\nreplayed {replayed}")
            checks.check(f"{phase}: ttyACM0 reads the recorded bytes",
                         replayed_serial != "" and replayed_serial == recorded_serial,
                         f"recorded {recorded_serial!r}, replayed {replayed_serial!r}")
            check_reports(checks, phase, {name: reports[phase, name] for name in DEVICES})

        dmesg = g.collect("@@DMESG-BEGIN", "@@DMESG-END", 60)
        print(f"guest dmesg (USB lines):\n{dmesg}", flush=True)
        checks.check("no 'already given back' in dmesg", "given back" not in dmesg, dmesg)
        checks.check("no short HID reports in dmesg", "was too short" not in dmesg, dmesg)
        checks.check("guest script exit code", g.finish(60) == 0)
        guest.stop(servers)
        servers = []
        logs["replay"].close()
        ended, log_text = replay_lines(log_paths["replay"], "replay server")
        for name in DEVICES:
            checks.check(f"the replay server logs `replay ended as recorded` for the {name}, for each client",
                         sum("replay ended as recorded" in line and recordings[name] in line for line in ended)
                         == len(REPLAYS), log_text[-3000:])
    except Exception as error:  # a wait that timed out is a failure with a reason
        checks.check("test ran to the end", False, str(error))
    finally:
        if g:
            g.kill()
        guest.stop(servers)
        for log in logs.values():
            log.close()
    print(f"test ran {time.time() - started:.1f} s", flush=True)
    checks.exit()


if __name__ == "__main__":
    main()
