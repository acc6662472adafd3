#!/usr/bin/env python3
"""Stay attached through network blips (issue 11): a disk mounted through
`usbwire attach` in a vhci-hcd guest keeps working while the TCP connection
under it is cut again and again.

Host: `usbwire serve` with a 128 MiB SuperSpeed disk, and in front of it a
cutting proxy (cutproxy.py) on host loopback. Guest (Debian's kernel under
QEMU): `usbwire attach -r 10.0.2.2:PROXY -b 2-1` returns once attached and
leaves a relay running that resumes the session when its connection drops,
so the kernel never sees a disconnect. The guest makes an ext4 filesystem on
the disk and writes a 64 MiB file of random data (from tmpfs, checksummed
first) in 1 MiB pieces with a sync every 4 MiB, reads it back after dropping
the caches, and does so again from a second source, pass after pass, until
the host is done cutting. Meanwhile the host cuts every live connection
(RST, FIN, 5-second black hole), 1.5-3 s apart, each time after the relay
has reconnected and the server has logged "resumed": the 12 cuts of PLAN,
and on until at least 10 of them hit a write. Then the guest checks the
file's sha256 once more, the mount, the device name and dmesg (no
disconnect, reset, I/O or ext4 error), and detaches; the host checks the
proxy's and the server's counts and that the detach released the device at
once. A kernel message about a cut, or a relay that does not come back
within 25 s, ends the test at that cut with what happened.

Run: python3 tests/interop/test_resume.py   (USBWIRE_BIN=path/to/usbwire)
"""

import os
import queue
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cutproxy  # noqa: E402
import guest  # noqa: E402

BIN = guest.BIN
MKE2FS = "/sbin/mke2fs"
NAME = "resume"
# The cuts, in order: 5 RST, 4 FIN, 3 black holes.
PLAN = ["rst", "fin", "blackhole", "rst", "fin", "rst", "blackhole", "fin", "rst", "fin", "blackhole", "rst"]
HOLE_SECONDS = 5.0
# The plan is cut through, and on until this many cuts hit the guest's writes (it also reads).
MIN_CUTS_IN_WRITES = 10
MAX_CUTS = 24
# How long the relay may take to come back after a cut (the server's grace is 30 s).
RECONNECT_TIMEOUT = 25
# Kernel messages that mean the kernel noticed a cut.
BAD_KERNEL = ["USB disconnect", "I/O error", "reset SuperSpeed", "reset high-speed", "EXT4-fs error",
              "Aborting journal", "given back"]

GUEST_SCRIPT = r"""
set -u
FAILS=0
check() { if [ "$2" = 0 ]; then echo "@@CHECK $1 PASS"; else echo "@@CHECK $1 FAIL ${3:-}"; FAILS=$((FAILS+1)); fi; }
# A step the rest cannot do without: on failure, say so and stop.
must() { check "$@"; [ "$2" = 0 ] || { echo "@@ABORT $1"; exit 1; }; }
stamp() { echo "@@T $1 $(cut -d' ' -f1 /proc/uptime)"; }
S=10.0.2.2:__PROXY__
DONE=__DONE__

# Kernel messages about USB, SCSI and the filesystem, live on the console.
(while IFS= read -r l; do
  case "$l" in *usb*|*USB*|*vhci*|*scsi*|*sd[a-z]*|*EXT4*|*I/O*|*reset*|*rror*) echo "@@KMSG $l";; esac
done < /proc/kmsg) &

[ -d /sys/devices/platform/vhci_hcd.0 ] || modprobe vhci-hcd 2>/dev/null
[ -d /sys/devices/platform/vhci_hcd.0 ]; must vhci-loaded $?
before=" $(ls /sys/block | tr '\n' ' ')"

# attach must return once the device is attached, leaving its relay behind.
stamp attach
timeout 60 usbwire attach -r $S -b 2-1 > /tmp/attach.out 2>&1
must attach-returns $? "$(cat /tmp/attach.out)"
echo "@@ATTACH-OUT $(tr '\n' '|' < /tmp/attach.out)"
PORT=$(sed -n 's/.* port \([0-9][0-9]*\).*/\1/p' /tmp/attach.out | head -n 1)
[ -n "$PORT" ]; must attach-names-port $? "$(cat /tmp/attach.out)"
grep -q resumable /tmp/attach.out; check attach-resumable $? "$(cat /tmp/attach.out)"
echo "@@RELAY $(ps | grep '[u]sbwire' | tr -s ' ' | tr '\n' '|')"

DEV=""; i=0
while [ -z "$DEV" ] && [ $i -lt 150 ]; do
  for b in /sys/block/sd*; do
    [ -e "$b" ] || continue; n=${b##*/}
    case "$before " in *" $n "*) ;; *) DEV=$n;; esac
  done
  [ -n "$DEV" ] || sleep 0.2; i=$((i+1))
done
[ -n "$DEV" ]; must disk-appears $? "no new /sys/block/sd* within 30 s"
echo "@@DISK $DEV"
readlink -f /sys/block/$DEV | grep -q vhci_hcd; must disk-on-vhci $? "$(readlink -f /sys/block/$DEV)"
[ "$(cat /sys/block/$DEV/size)" = 262144 ]; check disk-128MiB $? "$(cat /sys/block/$DEV/size) sectors"
i=0; while [ ! -b /dev/$DEV ] && [ $i -lt 50 ]; do sleep 0.2; i=$((i+1)); done
sleep 1

stamp mkfs
/usr/sbin/mkfs.ext4 -q -F /dev/$DEV > /tmp/mkfs.out 2>&1; must mkfs-ext4 $? "$(cat /tmp/mkfs.out)"
mount -t ext4 /dev/$DEV /mnt; must mount $?

# Two 64 MiB sources in tmpfs; their checksums are taken before a byte reaches the disk.
mkdir -p /src && mount -t tmpfs -o size=140m tmpfs /src
stamp source
dd if=/dev/urandom of=/src/a bs=1M count=64 2>/dev/null && dd if=/dev/urandom of=/src/b bs=1M count=64 2>/dev/null
must source-made $?
SUM_a=$(sha256sum /src/a | cut -d' ' -f1); SUM_b=$(sha256sum /src/b | cut -d' ' -f1)
echo "@@SOURCE-SHA256 a=$SUM_a b=$SUM_b"

# Write the 64 MiB file, 1 MiB at a time with a sync every 4 MiB, from a and b in turn
# (a lost write leaves the other source's bytes behind), and read each pass back after
# dropping the caches; again and again until the host is done cutting (it listens on DONE
# then; the final check below reads the last pass back). The @@WRITING / @@READING lines
# tell the host what a cut interrupted.
echo "@@WRITE-START"
pass=0; src=a; LAST=""; rc=0
while :; do
  pass=$((pass+1)); stamp pass-$pass
  i=0
  while [ $i -lt 64 ]; do
    dd if=/src/$src of=/mnt/data bs=1M skip=$i seek=$i count=1 conv=notrunc 2>/tmp/dd.err || { rc=1; break; }
    i=$((i+1))
    if [ $((i % 4)) = 0 ]; then sync || { rc=1; break; }; echo "@@WRITING pass $pass: $i of 64 MiB from $src"; fi
  done
  check pass-$pass-write $rc "stopped at $i MiB: $(cat /tmp/dd.err)"
  [ $rc = 0 ] || break
  LAST=$src
  nc -w 2 10.0.2.2 $DONE </dev/null >/dev/null 2>&1 && break
  echo "@@READING pass $pass"
  echo 3 > /proc/sys/vm/drop_caches
  eval want=\$SUM_$src
  got=$(sha256sum /mnt/data | cut -d' ' -f1)
  [ "$got" = "$want" ]; check pass-$pass-read-back $? "wrote $want ($src), read back $got"
  echo "@@IDLE"
  nc -w 2 10.0.2.2 $DONE </dev/null >/dev/null 2>&1 && break
  [ $pass -ge 8 ] && break
  if [ $src = a ]; then src=b; else src=a; fi
done
stamp write-done
echo "@@WRITE-DONE passes=$pass"

# After the last cut: everything on the disk, nothing in the caches, read back once more.
stamp verify
sync; echo 3 > /proc/sys/vm/drop_caches
[ -n "$LAST" ]; must a-pass-completed $?
eval SUM=\$SUM_$LAST
GOT=$(sha256sum /mnt/data | cut -d' ' -f1)
[ "$GOT" = "$SUM" ]; check data-sha256 $? "last written from $LAST ($SUM), read back $GOT"
[ "$(stat -c %s /mnt/data)" = 67108864 ]; check data-size $? "$(stat -c %s /mnt/data) bytes"
grep -q "^/dev/$DEV /mnt ext4 rw" /proc/mounts; check still-mounted-rw $? "$(grep /mnt /proc/mounts)"
new=""; for b in /sys/block/sd*; do n=${b##*/}; case "$before " in *" $n "*) ;; *) new="$new $n";; esac; done
[ "$new" = " $DEV" ]; check same-block-device $? "was $DEV, now:$new"
for pat in "USB disconnect" "I/O error" "reset SuperSpeed" "reset high-speed" "EXT4-fs error" "Aborting journal" "given back"; do
  n=$(dmesg | grep -c "$pat")
  check "dmesg-no-$(echo "$pat" | tr ' /' '--')" $([ "$n" = 0 ]; echo $?) "$n line(s): $(dmesg | grep "$pat" | head -n 3 | tr '\n' '|')"
done
echo "@@DMESG-BEGIN"; dmesg | grep -iE "usb|vhci|scsi|sd[a-z]|ext4|i/o|reset|error" | tail -n 80; echo "@@DMESG-END"
stamp verify-done

umount /mnt; check umount $?
usbwire port --json > /tmp/port.json 2>&1; echo "@@PORTS $(cat /tmp/port.json)"
grep -q "\"port\":$PORT[,}]" /tmp/port.json; check port-listed $? "$(cat /tmp/port.json)"
echo "@@DETACHING"
usbwire detach -p $PORT > /tmp/detach.out 2>&1; check detach $? "$(cat /tmp/detach.out)"
i=0; while [ -e /sys/block/$DEV ] && [ $i -lt 50 ]; do sleep 0.2; i=$((i+1)); done
[ ! -e /sys/block/$DEV ]; check disk-gone $?
i=0; while ps | grep -q '[u]sbwire' && [ $i -lt 50 ]; do sleep 0.2; i=$((i+1)); done
! ps | grep -q '[u]sbwire'; check relay-stopped $? "$(ps | grep '[u]sbwire' | tr '\n' '|')"
sed 's/^/@@RELAYLOG /' /var/run/vhci_hcd/usbwire-relay.log 2>/dev/null | tail -n 60
echo "@@END fails=$FAILS"
[ $FAILS -lt 100 ] || FAILS=99
exit $FAILS
"""


class Console:
    """Reads the guest's console: turns @@CHECK lines into checks and keeps the
    kernel messages (@@KMSG) that say the kernel noticed a cut."""

    def __init__(self, g, checks):
        self.g = g
        self.checks = checks
        self.kmsg = []
        self.bad = []
        self.phase = ("setup", "setting up")  # what the guest's disk I/O is doing: write, read, idle, done
        self.backlog = []  # lines poll() read that until() has not gone past yet

    def _take(self, line):
        if line.startswith("@@CHECK "):
            parts = line.split(" ", 3)
            self.checks.check(f"guest: {parts[1]}", parts[2] == "PASS", parts[3] if len(parts) > 3 else "")
        elif line.startswith("@@KMSG "):
            self.kmsg.append(line[7:])
            if any(p in line for p in BAD_KERNEL):
                self.bad.append(line[7:])
        elif line.startswith("@@WRITE-START"):
            self.phase = ("write", "writing pass 1")
        elif line.startswith("@@WRITING "):
            self.phase = ("write", line[2:].lower())
        elif line.startswith("@@READING "):
            self.phase = ("read", line[2:].lower())
        elif line.startswith("@@IDLE"):
            self.phase = ("idle", "between passes")
        elif line.startswith("@@WRITE-DONE"):
            self.phase = ("done", "done")
        elif line.startswith("@@ABORT "):
            raise RuntimeError(f"guest gave up at {line.split()[1]} (console: {self.g.console_path})")
        return line

    def poll(self):
        while True:
            try:
                line = self.g.lines.get_nowait()
            except queue.Empty:
                return
            self.backlog.append(line if line is None else self._take(line))
            if line is None:
                return

    def until(self, marker, timeout):
        """The first line with `marker`, or an exception saying what was awaited."""
        while self.backlog:
            line = self.backlog.pop(0)
            if line is None:
                self.backlog.append(None)
                raise RuntimeError(f"guest stopped before {marker!r} (console: {self.g.console_path})")
            if marker in line:
                return line
        deadline = time.time() + timeout
        while True:
            left = deadline - time.time()
            if left <= 0:
                raise TimeoutError(f"no {marker!r} from the guest within {timeout} s (console: {self.g.console_path})")
            try:
                raw = self.g.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if raw is None:
                self.backlog.append(None)
                raise RuntimeError(f"guest stopped before {marker!r} (console: {self.g.console_path})")
            line = self._take(raw)
            if marker in line:
                return line

    def sleep(self, seconds):
        """Sleeps while reading the console (so a kernel complaint is seen at once)."""
        deadline = time.time() + seconds
        while time.time() < deadline:
            self.poll()
            time.sleep(min(0.1, max(0, deadline - time.time())))
        self.poll()


class ServerLog:
    """The server's log file (its first `lines` lines, if given)."""

    def __init__(self, path, lines=None):
        self.path = path
        self.lines = lines

    def text(self):
        with open(self.path, errors="replace") as f:
            text = f.read()
        return text if self.lines is None else "\n".join(text.splitlines()[:self.lines])

    def resumed(self):
        """Lines of the server's "resumed" event (not "not resumed within ...")."""
        return [line for line in self.text().splitlines()
                if re.search(r"\bresumed\b", line) and "not resumed" not in line and "resumed connection lost" not in line]

    def count(self, needle):
        return sum(needle in line for line in self.text().splitlines())

    def tail(self, n=8):
        return "\n    ".join(self.text().splitlines()[-n:])

    def wait(self, predicate, timeout):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if predicate():
                return True
            time.sleep(0.1)
        return predicate()


def cut_phase(checks, console, proxy, server_log, seed):
    """The cuts; raises with what went wrong as soon as something does. Cuts the
    plan through, and on (cycling through it) until at least MIN_CUTS_IN_WRITES
    landed while the guest was writing; returns (seconds, cuts by guest phase)."""
    rng = random.Random(seed)
    print(f"cutting (seed {seed}): {' '.join(PLAN)}, then on until {MIN_CUTS_IN_WRITES} cuts hit writes", flush=True)
    started = time.time()
    phases = {}
    k = 0
    while k < len(PLAN) or phases.get("write", 0) < MIN_CUTS_IN_WRITES:
        if k >= MAX_CUTS:
            raise RuntimeError(f"{k} cuts, only {phases.get('write', 0)} while the guest was writing")
        k += 1
        mode = PLAN[(k - 1) % len(PLAN)]
        console.sleep(rng.uniform(1.5, 3.0))
        if console.bad:
            raise RuntimeError(f"before cut {k}: the kernel noticed: {console.bad[0]}")
        if console.phase[0] == "done":
            raise RuntimeError(f"before cut {k}: the guest stopped writing before the host was done")
        newest = proxy.stats()["connections"]
        n = proxy.cut(mode)
        phase, doing = console.phase
        phases[phase] = phases.get(phase, 0) + 1
        print(f"  cut {k:2}: {mode:9} ({n} connection(s)) at +{time.time() - started:5.1f} s; guest: {doing}",
              flush=True)
        if n == 0:
            raise RuntimeError(f"cut {k} ({mode}): no live connection to cut")
        # The relay reconnects through the proxy and the server resumes the session.
        deadline = time.time() + RECONNECT_TIMEOUT
        conn = None
        while time.time() < deadline and not console.bad:
            conn = conn or proxy.wait_new_connection(newest, 0.2)
            if conn and len(server_log.resumed()) >= k:
                break
            console.poll()
        if console.bad:
            raise RuntimeError(f"after cut {k} ({mode}): the kernel noticed: " + " | ".join(console.bad[:3]))
        if conn is None:
            stats = proxy.stats()
            raise RuntimeError(f"after cut {k} ({mode}): no new connection through the proxy within "
                               f"{RECONNECT_TIMEOUT} s ({stats['connections']} so far): nothing reconnected "
                               f"(was the kernel given the TCP socket itself?); server log:\n    {server_log.tail()}")
        if len(server_log.resumed()) < k:
            raise RuntimeError(f"after cut {k} ({mode}): connection {conn['id']} came, but the server logged "
                               f"{len(server_log.resumed())} 'resumed' for {k} cuts; server log:\n    {server_log.tail()}")
        print(f"      resumed on connection {conn['id']} after {time.time() - proxy.stats()['cut_log'][-1][0]:.1f} s",
              flush=True)
    return time.time() - started, phases


def main():
    guest.require(BIN, MKE2FS)
    guest.build()
    checks = guest.Checks()
    for name, ok, detail in cutproxy.selftest():
        checks.check(name, ok, detail)
    if checks.failed:
        checks.exit()

    work = tempfile.mkdtemp(prefix="usbwire-resume-")
    image = os.path.join(work, "disk.img")
    port = guest.free_port()
    log_path = os.path.join(guest.LOGS, f"{NAME}.server.log")
    server_log_file = open(log_path, "w")
    server = subprocess.Popen(
        [BIN, "serve", "-v", "--listen", f"127.0.0.1:{port}", "--no-advertise",
         "--control", os.path.join(work, "control.sock"),
         "--virtual", f"disk={image},size=128M,speed=super"],
        stdout=server_log_file, stderr=subprocess.STDOUT)
    server_log = ServerLog(log_path)
    proxy = cutproxy.CutProxy(("127.0.0.1", port), hole_seconds=HOLE_SECONDS)
    proxy_port = proxy.start()
    done = socket.socket()
    done.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    done_port = guest.free_port()
    seed = int(os.environ.get("RESUME_SEED", random.randrange(1 << 30)))
    g = None
    cut_ok = False
    before_detach = None  # server log lines up to the detach
    try:
        for _ in range(100):
            if subprocess.run([BIN, "list", "-r", f"127.0.0.1:{port}"], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"server did not come up; log: {log_path}")
        script = GUEST_SCRIPT.replace("__PROXY__", str(proxy_port)).replace("__DONE__", str(done_port))
        g = guest.Guest(NAME, script, files={BIN: "/usr/bin/usbwire", MKE2FS: "/usr/sbin/mkfs.ext4",
                                             "/etc/mke2fs.conf": "/etc/mke2fs.conf"}, timeout=330)
        console = Console(g, checks)
        console.until("@@BOOTED", 120)
        print(f"booted in {time.time() - g.started:.1f} s", flush=True)
        print(console.until("@@ATTACH-OUT", 90), flush=True)
        print(console.until("@@RELAY", 30), flush=True)
        disk = console.until("@@DISK ", 60).split()[-1]
        console.until("@@WRITE-START", 150)
        print(f"write started at {time.time() - g.started:.1f} s (disk {disk})", flush=True)

        took, phases = cut_phase(checks, console, proxy, server_log, seed)
        cut_ok = True
        print(f"{sum(phases.values())} cuts in {took:.1f} s; while the guest was: "
              + ", ".join(f"{p} {n}" for p, n in sorted(phases.items())), flush=True)
        checks.check(f">= {MIN_CUTS_IN_WRITES} cuts while the guest was writing", phases.get("write", 0) >= MIN_CUTS_IN_WRITES,
                     phases)
        # Tell the guest to stop after its current pass.
        done.bind(("127.0.0.1", done_port))
        done.listen(4)

        def hang_up():
            try:
                while True:
                    conn, _ = done.accept()
                    conn.close()
            except OSError:
                pass

        threading.Thread(target=hang_up, daemon=True).start()
        print(console.until("@@WRITE-DONE", 120), flush=True)
        console.until("@@DMESG-BEGIN", 120)
        dmesg = []
        while True:
            line = console.until("", 30)
            if "@@DMESG-END" in line:
                break
            dmesg.append(line)
        console.until("@@DETACHING", 60)
        detached_at = time.time()
        before_detach = len(server_log.text().splitlines())

        def after_detach():
            return server_log.text().splitlines()[before_detach:]

        def released():
            return any("client disconnected" in line for line in after_detach())

        if server_log.wait(released, 10):
            checks.check("server releases the device within 10 s of the detach (\"client disconnected\")", True)
        else:
            # Say what the server did instead, and when (if at all) it let go.
            parked = any("holding the session" in line for line in after_detach())
            late = server_log.wait(released, 40)
            checks.check("server releases the device within 10 s of the detach (\"client disconnected\")", False,
                         ("it held the session for a resume instead; " if parked else "")
                         + (f"released only {time.time() - detached_at:.0f} s after the detach" if late
                            else f"not released {time.time() - detached_at:.0f} s after the detach")
                         + "; server log since the detach:\n    " + "\n    ".join(after_detach()[-8:]))
        end = console.until("@@END", 60)
        checks.check("guest: no failed check", end.strip().endswith("fails=0"), end)
        rc = g.finish(60)
        checks.check("guest script exit code", rc == 0, str(rc))
        if any(name.startswith("guest") for name in checks.failed):
            print("guest dmesg (usb/scsi/ext4/errors):\n  " + "\n  ".join(dmesg[-25:]))
        print(f"guest ran {time.time() - g.started:.1f} s", flush=True)
    except Exception as error:  # a wait that timed out is a failure with a reason
        checks.check("test ran to the end", False, str(error))
        if g and console.kmsg:
            print("last kernel messages from the guest:\n  " + "\n  ".join(console.kmsg[-15:]))
    finally:
        if g:
            g.kill()
        done.close()
        stats = proxy.stats()
        proxy.stop()
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
        server_log_file.close()

    # The session's life before the detach (after it, the server may hold it for a resume).
    cut_log = ServerLog(log_path, before_detach)
    resumed = cut_log.resumed()
    print(f"proxy: {stats['connections']} connections, {stats['cuts']} cuts; server: {len(resumed)} resumed", flush=True)
    for c in stats["conns"]:
        print(f"  connection {c['id']:2}: {c['up']:>10} B up, {c['down']:>10} B down, ended by {c['ended_by'] or '-'}")
    if cut_ok:
        checks.check("proxy made >= 10 cuts", stats["cuts"] >= 10, stats["cuts"])
        checks.check("proxy saw >= 11 connections", stats["connections"] >= 11, stats["connections"])
        checks.check("server logged 'resumed' for every cut", len(resumed) >= stats["cuts"],
                     f"{len(resumed)} for {stats['cuts']} cuts")
        checks.check("server never gave up on the session", cut_log.count("not resumed within") == 0
                     and cut_log.count("resume refused") == 0,
                     "\n    ".join(line for line in cut_log.text().splitlines()
                                   if "not resumed" in line or "resume refused" in line))
    checks.check("server refused no import", server_log.count("import refused") == 0,
                 "\n    ".join(l for l in server_log.text().splitlines() if "import refused" in l))
    if checks.failed:
        print(f"logs: {g.console_path if g else ''} {log_path}")
    checks.exit()


if __name__ == "__main__":
    main()
