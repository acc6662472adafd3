#!/usr/bin/env python3
"""A disk recorded once, replayed to the real kernel's usb-storage: a vhci-hcd guest (Debian's
kernel under QEMU) imports `usbwire serve --virtual disk=IMAGE --capture DIR` (an ext4 image made
on the host with a few files), waits for the disk, mounts it read-only, takes the files' SHA-256
and detaches. The server stops, and `usbwire serve --virtual replay=CAPTURE,mode=lenient` and
`...,mode=strict` serve the recording back: the same guest attaches each the same way and runs the
same workload, with no disk image behind them.

Checked: the disk appears as a block device and mounts in every phase; the SHA-256 of each file
is the image's in the recording and the same in each replay; each replay's report (printed
whole) has 0 divergences and nothing of the recording left unasked, and the server logs `replay
ended as recorded`; dmesg has no `given back`, no I/O error and no reset.

What makes a disk replayable, and what the guest does for it (as a CI set-up would):
- CBW tags: the replay matches a CBW in all but its tag and gives the recorded CSW the host's
  tag (usb-storage numbers its commands from 1 for each device it binds; other hosts do not).
- Media-change polling: the disk is removable, and with polling on (udev's 60-block.rules sets
  `block.events_dfl_poll_msecs` to 2000 when the block module loads) the block layer sends a
  TEST UNIT READY at its own pace, as many as the time the disk stays open allows. The replay
  answers one the recording lacks at that place as the last recorded TEST UNIT READY was
  answered (it passed), without moving the recording on, and counts it
  (`ready_checks_answered`). The recording is made with polling off (this guest runs no udev: the
  kernel's default of 0 stands, checked); each replay sets the disk's `events_poll_msecs` to 500
  and keeps the disk mounted 2 s longer, and its report must show the polls answered with 0
  divergences. (Polls in a recording that a replay's host does not send are passed over with
  their CSWs, `ready_checks_passed_over`; unit-tested in crates/gadgets.)
- Reads: the filesystem is mounted read-only on a device new to the page cache, so the READ(10)s
  (the mount's, then readahead growing 32 to 240 sectors over the large file) are the same each
  time the same kernel runs the same workload.
- `usbwire attach --accelerate off` (the default here; USBWIRE_REPLAY_ACCELERATE=auto for the
  other): the accelerator's own read-ahead READs (tags 0x5a0000NN) are recorded too and are sent
  again the same way, so `auto` replays with 0 divergences as well; `off` records only what
  usb-storage sent.

Run: python3 tests/interop/test_replay_disk.py   (USBWIRE_BIN=path/to/usbwire)
"""

import hashlib
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import guest  # noqa: E402
from test_replay_kernel import listening, replay_lines  # noqa: E402

BIN = guest.BIN
ACCELERATE = os.environ.get("USBWIRE_REPLAY_ACCELERATE", "off")
# The files on the image: name -> content (a few sizes: one block, several, a larger one).
FILES = {
    "hello.txt": b"recorded through usb-storage, replayed to usb-storage\n",
    "blocks.bin": bytes((i * 7 + 3) % 251 for i in range(40 * 1024)),
    "large.bin": hashlib.sha256(b"usbwire").digest() * (300 * 1024 // 32),
}
# The phases in order: the recording, then the replays (their modes).
PHASES = ["record", "lenient", "strict"]

GUEST_SCRIPT = r"""
set -u
# phase NAME PORT [BUSID]: import the disk (BUSID, 0-1 unless named) of the server at PORT, mount
# it read-only, hash its files, unmount and detach.
phase() {
  N=$1; S=10.0.2.2:$2; B=${3:-0-1}
  wait_for "usbwire list -r $S 2>/dev/null | grep -q ' $B: '" 1800; check $N-listed $?
  usbwire attach -r $S -b $B __ACCELERATE__ > /tmp/attach.out 2>&1; check $N-attach $? "$(cat /tmp/attach.out)"
  wait_for '[ -e /sys/block/sda ] && [ -e /dev/sda ] && [ "$(cat /sys/block/sda/size)" != 0 ]' 600; check $N-disk $?
  # The recording is made without media polling; each replay polls every 500 ms (as udev sets
  # 2 s) and holds the disk 2 s longer, so its polls are not the recording's.
  [ $N = record ] || echo 500 > /sys/block/sda/events_poll_msecs
  POLL=$(cat /sys/block/sda/events_poll_msecs); DFL=$(cat /sys/module/block/parameters/events_dfl_poll_msecs)
  echo "@@$N-DISK $(cat /sys/block/sda/size) sectors, removable $(cat /sys/block/sda/removable)," \
    "events_poll_msecs $POLL, block.events_dfl_poll_msecs $DFL"
  if [ $N = record ]; then [ "$DFL" = 0 ] && [ "$POLL" -le 0 ]; else [ "$POLL" = 500 ]; fi
  check $N-media-polling $?
  mount -t ext4 -o ro /dev/sda /mnt > /tmp/mount.out 2>&1; check $N-mount $? "$(cat /tmp/mount.out)"
  echo "@@$N-SHA-BEGIN"; (cd /mnt && sha256sum __FILES__); echo "@@$N-SHA-END"
  [ $N = record ] || sleep 2
  umount /mnt; check $N-umount $?
  rc=0
  for p in $(usbwire port --json | tr ',{}' '\n\n\n' | sed -n 's/.*"port":\([0-9]*\).*/\1/p'); do usbwire detach -p $p || rc=1; done
  check $N-detach $rc
  wait_for '[ ! -e /sys/block/sda ]' 300; check $N-disk-gone $?
  echo "@@$N-DETACHED"
}
__PHASES__
echo "@@DMESG-BEGIN"
dmesg | grep -iE "vhci_hcd.0: (devid|Device)|vhci_hcd: disconnect|usb [0-9]-|usb-storage|scsi|sd |sda|EXT4|given back|error|reset"
echo "@@DMESG-END"
exit 0
"""


def make_image(work):
    """An ext4 image (16 MiB) with FILES, made by mke2fs -d; returns its path."""
    tree = os.path.join(work, "files")
    os.makedirs(tree)
    for name, data in FILES.items():
        with open(os.path.join(tree, name), "wb") as f:
            f.write(data)
    image = os.path.join(work, "disk.img")
    subprocess.run(["mke2fs", "-q", "-F", "-t", "ext4", "-L", "replayed", "-d", tree, image, "16M"],
                   check=True, capture_output=True)
    return image


def hashes(text):
    """{name: sha256} from sha256sum's lines."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and len(parts[0]) == 64:
            out[parts[1]] = parts[0]
    return out


def run_phase(g, checks, name):
    """The guest's `phase NAME` (GUEST_SCRIPT) against one server, checked step by step; returns
    the files' SHA-256 as it read them."""
    phase_started = time.time()
    for step in ["listed", "attach", "disk", None, "media-polling", "mount"]:
        if step is None:
            print(g.wait_for(f"@@{name}-DISK", 60), flush=True)
            continue
        line = g.wait_for(f"@@CHECK {name}-{step} ", 300)
        checks.check(f"guest: {name}-{step}", " PASS" in line, line)
    got = hashes(g.collect(f"@@{name}-SHA-BEGIN", f"@@{name}-SHA-END", 180))
    for step in ["umount", "detach", "disk-gone"]:
        line = g.wait_for(f"@@CHECK {name}-{step} ", 180)
        checks.check(f"guest: {name}-{step}", " PASS" in line, line)
    g.wait_for(f"@@{name}-DETACHED", 60)
    print(f"{name}: {time.time() - phase_started:.1f} s, SHA-256 {got}", flush=True)
    return got


def main():
    guest.require(BIN)
    guest.build()
    checks = guest.Checks()
    work = guest.scratch("usbwire-replay-disk-")
    ports = {}
    for phase in PHASES:
        port = guest.free_port()
        while port in ports.values():
            port = guest.free_port()
        ports[phase] = port
    image = make_image(work)
    expected = {name: hashlib.sha256(data).hexdigest() for name, data in FILES.items()}
    capture_dir = os.path.join(work, "capture")
    reports = {phase: os.path.join(work, f"{phase}.report.json") for phase in PHASES[1:]}
    log_paths = {phase: os.path.join(guest.LOGS, f"replay-disk.{phase}.log") for phase in PHASES}
    logs = {phase: open(path, "w") for phase, path in log_paths.items()}
    servers = [subprocess.Popen(
        [BIN, "serve", "-v", "--listen", f"127.0.0.1:{ports['record']}", "--no-advertise",
         "--control", os.path.join(work, "record.sock"), "--capture", capture_dir,
         "--virtual", f"disk={image},size=16M"],
        stdout=logs["record"], stderr=subprocess.STDOUT)]
    g = None
    started = time.time()
    try:
        checks.check("the recording server listens", listening(ports["record"], servers[0]), log_paths["record"])
        script = (GUEST_SCRIPT.replace("__ACCELERATE__", f"--accelerate {ACCELERATE}")
                  .replace("__FILES__", " ".join(FILES))
                  .replace("__PHASES__", "\n".join(f"phase {p} {ports[p]}" for p in PHASES)))
        g = guest.Guest("replay-disk", script, files={BIN: "/usr/bin/usbwire"}, timeout=480)
        g.wait_for("@@BOOTED", 180)
        print(f"guest booted in {time.time() - g.started:.1f} s", flush=True)

        # Phase 1: record the disk while usb-storage mounts it and ext4 reads the files.
        recorded = run_phase(g, checks, "record")
        checks.check("record: the files' SHA-256 are the image's", recorded == expected,
                     f"expected {expected}, got {recorded}")
        # A capture is complete once the server has stopped.
        guest.stop(servers)
        servers = []
        files = sorted(os.listdir(capture_dir)) if os.path.isdir(capture_dir) else []
        mine = [f for f in files if f.startswith("usbwire-0-1-") and f.endswith(".pcapng")]
        checks.check("the capture directory has one recording of the disk", len(mine) == 1, files)
        if len(mine) != 1:
            raise RuntimeError(f"no single recording in {capture_dir}: {files}")
        recording = os.path.join(capture_dir, mine[0])
        print(f"recording: {mine[0]}, {os.path.getsize(recording)} bytes", flush=True)

        # Phase 2: the recording served back, leniently then strictly; no image behind it.
        for phase in PHASES[1:]:
            servers.append(subprocess.Popen(
                [BIN, "serve", "-v", "--listen", f"127.0.0.1:{ports[phase]}", "--no-advertise",
                 "--control", os.path.join(work, f"{phase}.sock"),
                 "--virtual", f"replay={recording},mode={phase},report={reports[phase]}"],
                stdout=logs[phase], stderr=subprocess.STDOUT))
            checks.check(f"the {phase} replay server listens", listening(ports[phase], servers[-1]), log_paths[phase])
        for phase in PHASES[1:]:
            replayed = run_phase(g, checks, phase)
            checks.check(f"{phase} replay: the files' SHA-256 are the recorded ones",
                         replayed == recorded and len(replayed) == len(FILES),
                         f"recorded {recorded}, replayed {replayed}")
            # A report is written when its import ends (the detach).
            deadline = time.time() + 30
            while not os.path.exists(reports[phase]) and time.time() < deadline:
                time.sleep(0.2)
            report = None
            if os.path.exists(reports[phase]):
                text = open(reports[phase]).read()
                print(f"{phase} replay report:\n{text}", flush=True)
                report = json.loads(text)
            checks.check(f"the {phase} replay wrote its report", report is not None, reports[phase])
            if report is not None:
                checks.check(f"the {phase} replay report has 0 divergences", report.get("divergences") == 0,
                             json.dumps(report.get("first_divergences"), indent=1))
                checks.check(f"the {phase} replay reached the recording's end (never_asked 0)",
                             report.get("never_asked") == 0, json.dumps(report.get("first_never_asked"), indent=1))
                checks.check(f"the {phase} replay answered usb-storage's requests from the recording",
                             report.get("requests", 0) > 0 and report.get("matched", 0) > 0,
                             f"requests {report.get('requests')}, matched {report.get('matched')}")
                checks.check(f"the {phase} replay answered the block layer's media polls (ready_checks_answered > 0)",
                             report.get("ready_checks_answered", 0) > 0,
                             f"ready_checks_answered {report.get('ready_checks_answered')}")

        dmesg = g.collect("@@DMESG-BEGIN", "@@DMESG-END", 60)
        print(f"guest dmesg (USB and disk lines):\n{dmesg}", flush=True)
        checks.check("no 'already given back' in dmesg", "given back" not in dmesg, dmesg)
        checks.check("no I/O error or reset in dmesg",
                     not any(w in dmesg.lower() for w in ("i/o error", "reset high-speed", "reset super")), dmesg)
        checks.check("guest script exit code", g.finish(60) == 0)
        guest.stop(servers)
        servers = []
        for phase in PHASES[1:]:
            logs[phase].close()
            ended, log_text = replay_lines(log_paths[phase], f"{phase} replay server")
            checks.check(f"the {phase} replay server logs `replay ended as recorded`",
                         any("replay ended as recorded" in line for line in ended), log_text[-3000:])
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
