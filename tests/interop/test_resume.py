#!/usr/bin/env python3
"""Stay attached through network blips (issue 11): a disk mounted through
`usbwire attach` in a vhci-hcd guest keeps working while the TCP connection
under it is cut again and again.

Host: `usbwire serve` with a 128 MiB SuperSpeed disk, and in front of it a
cutting proxy (cutproxy.py) on host loopback. Guest (Debian's kernel under
QEMU): `usbwire attach -r 10.0.2.2:PROXY -b 0-1` returns once attached and
leaves a relay running that resumes the session when its connection drops,
so the kernel never sees a disconnect. The guest makes an ext4 filesystem on
the disk and writes a 64 MiB file of random data (from tmpfs, checksummed
first) in 1 MiB pieces with a sync every 4 MiB, reads it back after dropping
the caches, and does so again from a second source, pass after pass, until
the host is done cutting. Meanwhile the host cuts every live connection
(RST, FIN, 5-second black hole, and the silent ones: RST to the server
only with the guest's side left open and mute, or both sides left open and
mute, which only keep-alive can notice), 1.5-3 s apart, each time after the
relay has reconnected and the server has logged "resumed": the 12 cuts of
PLAN, and on until at least 10 silent ones hit a write. Then the guest checks the
file's sha256 once more, the mount, the device name and dmesg (no
disconnect, reset, I/O or ext4 error), and detaches; the host checks the
proxy's and the server's counts and that the detach released the device at
once.

Then, in the same guest, the serial device (`--virtual serial=LINK`, a pty
on the host): `usbwire attach` through the proxy, /dev/ttyACM0 held open and
raw, and numbered lines stream both ways at once, "g NNNNN" guest -> host and
"h NNNNN" host -> guest, 10 every 0.1 s, at least 3000 each way and on until
the host is done cutting (it listens on a second "done" port), then an "END
<count>" line. The host reads the pty all the time (a full pty would stall
the device) and cuts as in the disk phase, each time after the session has
resumed and carried new lines, until 10 cuts (6 of them silent) hit the stream. Each side then
checks what it received: every line once, in order, none missing, none
doubled, no garbage, the byte count exact; and dmesg since the serial
attach has no disconnect, reset or failure and the tty is still ttyACM0.

A kernel message about a cut, a relay that does not come back within 25 s,
or a stream that carries nothing new for 25 s after a cut, ends the test at
that cut with what happened.

Run: python3 tests/interop/test_resume.py   (USBWIRE_BIN=path/to/usbwire)
"""

import os
import queue
import random
import re
import select
import socket
import subprocess
import sys
import threading
import time
import tty

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cutproxy  # noqa: E402
import guest  # noqa: E402

BIN = guest.BIN
MKE2FS = "/sbin/mke2fs"
NAME = "resume"
# The cuts, in order: 2 RST, 2 FIN, 2 black holes, and 6 that tell the guest nothing (the
# server's side reset, or both sides left open and silent: only keep-alive notices those).
PLAN = ["server-rst", "rst", "stall", "fin", "server-rst", "blackhole", "stall", "rst", "server-rst", "fin",
        "stall", "blackhole"]
HOLE_SECONDS = 5.0
# The plan is cut through, and on until this many silent cuts hit the guest's writes (it also reads).
MIN_CUTS_IN_WRITES = 10
MAX_CUTS = 36
# Until that many have, every other cut waits up to this long for the guest to be in the busy
# phase (the time split between writing and reading varies by machine; CI once saw 8 of 24).
BUSY_WAIT_SECONDS = 30
# How long the relay may take to come back after a cut (the server's grace is 30 s).
RECONNECT_TIMEOUT = 25
# The serial phase: the same plan, and on until this many silent cuts hit the two-way stream
# (and at least MIN_CUTS_IN_STREAM cuts in all).
MIN_SILENT_IN_STREAM = 6
MIN_CUTS_IN_STREAM = 10
# Lines each way: BATCH every 0.1 s, at least MIN_LINES and on until the host is done cutting.
SERIAL_BATCH = 10
MIN_LINES = 3000
MAX_LINES = 99999
# Kernel messages that mean the kernel noticed a cut.
BAD_KERNEL = ["USB disconnect", "I/O error", "reset SuperSpeed", "reset high-speed", "EXT4-fs error",
              "Aborting journal", "given back"]

GUEST_SCRIPT = r"""
set -u
FAILS=0
# A step the rest cannot do without: on failure, say so and stop.
must() { check "$@"; [ "$2" = 0 ] || { echo "@@ABORT $1"; exit 1; }; }
stamp() { echo "@@T $1 $(cut -d' ' -f1 /proc/uptime)"; }
S=10.0.2.2:__PROXY__
DONE=__DONE__
MAXPASS=__MAXPASS__
SBUS=__SBUS__; SDONE=__SDONE__; BATCH=__BATCH__; MINL=__MINL__; MAXL=__MAXL__

# Kernel messages about USB, SCSI and the filesystem, live on the console.
(while IFS= read -r l; do
  case "$l" in *usb*|*USB*|*vhci*|*scsi*|*sd[a-z]*|*EXT4*|*I/O*|*reset*|*rror*|*acm*|*ACM*|*tty*|*fail*) echo "@@KMSG $l";; esac
done < /proc/kmsg) &

[ -d /sys/devices/platform/vhci_hcd.0 ] || modprobe vhci-hcd 2>/dev/null
[ -d /sys/devices/platform/vhci_hcd.0 ]; must vhci-loaded $?
before=" $(ls /sys/block | tr '\n' ' ')"

# attach must return once the device is attached, leaving its relay behind.
stamp attach
timeout 60 usbwire attach -r $S -b 0-1 > /tmp/attach.out 2>&1
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
  # A safety net should the host never say DONE: it makes at most MAX_CUTS cuts, each
  # after 1.5 s or more, so it is done long before this many 64 MiB passes.
  [ $pass -ge $MAXPASS ] && break
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

# ---- Serial: a ttyACM streams numbered lines both ways while the host cuts ----
# The disk phase's detach is in dmesg; from here on only the serial device's messages count.
dmesg -c > /dev/null
echo "@@SERIAL-PHASE"
stamp serial-attach
timeout 60 usbwire attach -r $S -b $SBUS > /tmp/sattach.out 2>&1
must serial-attach-returns $? "$(cat /tmp/sattach.out)"
echo "@@SERIAL-ATTACH-OUT $(tr '\n' '|' < /tmp/sattach.out)"
SPORT=$(sed -n 's/.* port \([0-9][0-9]*\).*/\1/p' /tmp/sattach.out | head -n 1)
[ -n "$SPORT" ]; must serial-attach-names-port $? "$(cat /tmp/sattach.out)"
grep -q resumable /tmp/sattach.out; check serial-attach-resumable $? "$(cat /tmp/sattach.out)"
TTY=/dev/ttyACM0
i=0; while [ ! -c $TTY ] && [ $i -lt 150 ]; do sleep 0.2; i=$((i+1)); done
[ -c $TTY ]; must serial-tty-appears $? "no $TTY within 30 s; /dev has: $(ls /dev | grep -i tty | tr '\n' ' ')"
readlink -f /sys/class/tty/ttyACM0 | grep -q vhci_hcd; check serial-tty-on-vhci $? "$(readlink -f /sys/class/tty/ttyACM0)"
# Held open for the whole phase: a last close would drop DTR and flush the line.
exec 3<>$TTY; must serial-open $?
stty -F $TTY raw -echo -iexten; must serial-stty-raw $?
echo "@@SERIAL-STTY $(stty -F $TTY -a | tr '\n' ' ')"
cat $TTY > /tmp/serial-in & CATPID=$!
# The host says it is done cutting by listening on SDONE.
rm -f /tmp/serial-stop
(while ! nc -w 2 10.0.2.2 $SDONE </dev/null >/dev/null 2>&1; do sleep 1; done; touch /tmp/serial-stop) &
sleep 0.5
exec 4>&1
echo "@@SERIAL-READY"
stamp serial-stream
# Guest -> host: "g NNNNN" lines, BATCH every 0.1 s, at least MINL of them and on until the
# host is done cutting; then "g END <count>".
n=0; werr=0
while :; do
  b=0
  while [ $b -lt $BATCH ]; do
    n=$((n+1)); b=$((b+1))
    printf 'g %05d\n' $n || { werr=1; echo "@@SERIAL-WRITE-ERROR writing g $n" >&4; }
  done
  [ $((n % 500)) -lt $BATCH ] && echo "@@SERIAL-WRITING $n lines" >&4
  if [ $n -ge $MINL ] && [ -e /tmp/serial-stop ]; then break; fi
  [ $n -ge $MAXL ] && break
  sleep 0.1
done >&3
printf 'g END %d\n' $n >&3 || werr=1
echo "@@SERIAL-SENT $n"
stamp serial-sent
check serial-writes-succeed $werr "a write to $TTY failed"
[ $n -lt $MAXL ]; check serial-host-said-done $? "wrote $MAXL lines and the host never said it was done"
# Host -> guest: wait for the host's END line (the host sends it once it has this side's END).
i=0; while ! grep -q '^h END' /tmp/serial-in && [ $i -lt 300 ]; do sleep 0.2; i=$((i+1)); done
grep -q '^h END' /tmp/serial-in
check serial-host-end-arrives $? "no 'h END' within 60 s; $(wc -l < /tmp/serial-in) lines, the last: $(tail -n 2 /tmp/serial-in | tr '\n' '|')"
sleep 1  # whatever might follow the END line arrives too (there must be nothing)
kill $CATPID; wait $CATPID 2>/dev/null
cat > /tmp/lines.awk <<'AWK'
# Lines "P NNNNN" numbered from 1, then "P END N": what is missing, doubled or garbled.
function note(t) { notes++; if (notes <= 20) print "@@SERIAL-RX-NOTE " t }
BEGIN { want = 1; good = 0; dup = 0; gap = 0; junk = 0; ends = 0; after = 0; endn = -1 }
{
  if (ends > 0) { after++; note("line " NR " after the END line: " substr($0, 1, 60)); next }
  if ($0 ~ ("^" p " END [0-9]+$")) { ends++; endn = $3 + 0; next }
  if ($0 ~ ("^" p " [0-9][0-9][0-9][0-9][0-9]$")) {
    s = $2; sub(/^0+/, "", s); v = s + 0  # not $2 + 0: busybox awk reads 00010 as octal
    if (v == want) { want++; good++; next }
    if (v < want) { dup++; note("line " NR ": " $0 " again (after " p " " (want - 1) ")"); next }
    gap += v - want; note("line " NR ": " $0 " follows " p " " (want - 1) ": " (v - want) " line(s) missing")
    want = v + 1; next
  }
  junk++; note("line " NR ": garbage \"" substr($0, 1, 60) "\" (after " p " " (want - 1) ")")
}
END {
  if (endn >= 0 && want - 1 < endn) { gap += endn - (want - 1); note("the last " (endn - want + 1) " line(s) missing: " p " " want " to " endn) }
  print "@@SERIAL-RX lines=" NR " good=" good " last=" (want - 1) " end=" endn " missing=" gap " doubled=" dup " garbage=" junk " after_end=" after
}
AWK
awk -v p=h -f /tmp/lines.awk /tmp/serial-in > /tmp/serial-rx; cat /tmp/serial-rx
RX=$(sed -n 's/^@@SERIAL-RX //p' /tmp/serial-rx)
E=$(echo "$RX" | sed -n 's/.* end=\([0-9-]*\) .*/\1/p'); L=$(echo "$RX" | sed -n 's/.* last=\([0-9]*\) .*/\1/p')
echo "$RX" | grep -q " missing=0 doubled=0 garbage=0 after_end=0$"
check serial-host-to-guest-each-line-once-in-order $? "$RX"
[ "$E" -ge $MINL ] && [ "$L" = "$E" ]; check serial-host-to-guest-all-lines $? "$RX (the END line gives the count; at least $MINL)"
B=$(wc -c < /tmp/serial-in); [ "$E" -ge 0 ] && [ "$B" = $((8 * E + 7 + ${#E})) ]
check serial-host-to-guest-bytes $? "$B bytes for $E lines and the END line"
dmesg > /tmp/sdmesg
echo "@@SERIAL-DMESG-BEGIN"; tail -n 40 /tmp/sdmesg; echo "@@SERIAL-DMESG-END"
for pat in "USB disconnect" "reset" "given back" "fail" "rror"; do
  n=$(grep -ci "$pat" /tmp/sdmesg)
  check "serial-dmesg-no-$(echo "$pat" | tr ' ' '-')" $([ "$n" = 0 ]; echo $?) "$n line(s): $(grep -i "$pat" /tmp/sdmesg | head -n 3 | tr '\n' '|')"
done
[ -c $TTY ] && [ ! -e /dev/ttyACM1 ]; check serial-same-tty $? "$(ls /dev | grep ttyACM | tr '\n' ' ')"
exec 3>&- 4>&-
usbwire port --json > /tmp/sport.json 2>&1
grep -q "\"port\":$SPORT[,}]" /tmp/sport.json; check serial-port-listed $? "$(cat /tmp/sport.json)"
echo "@@SERIAL-DETACHING"
usbwire detach -p $SPORT > /tmp/sdetach.out 2>&1; check serial-detach $? "$(cat /tmp/sdetach.out)"
i=0; while [ -e $TTY ] && [ $i -lt 50 ]; do sleep 0.2; i=$((i+1)); done
[ ! -e $TTY ]; check serial-tty-gone $?
i=0; while ps | grep -q '[u]sbwire' && [ $i -lt 50 ]; do sleep 0.2; i=$((i+1)); done
! ps | grep -q '[u]sbwire'; check serial-relay-stopped $? "$(ps | grep '[u]sbwire' | tr '\n' '|')"
sed 's/^/@@RELAYLOG /' /var/run/vhci_hcd/usbwire-relay.log 2>/dev/null | tail -n 40
stamp serial-done
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
        elif line.startswith("@@SERIAL-PHASE"):
            # The disk's detach is behind: what the kernel says from here is about the serial device.
            self.bad = []
            self.phase = ("setup", "attaching the serial device")
        elif line.startswith("@@SERIAL-READY"):
            self.phase = ("stream", "streaming")
        elif line.startswith("@@SERIAL-WRITING "):
            self.phase = ("stream", "streaming, " + line.split(" ", 1)[1] + " written")
        elif line.startswith("@@SERIAL-SENT "):
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

    def resumed(self, busid=None, start=0):
        """Lines of the server's "resumed" event (not "not resumed within ..."), of one
        device's session if `busid` is given, from line `start` on."""
        return [line for line in self.text().splitlines()[start:]
                if re.search(r"\bresumed\b", line) and "not resumed" not in line and "resumed connection lost" not in line
                and (busid is None or f"busid={busid} " in line)]

    def mark(self):
        return len(self.text().splitlines())

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


def check_lines(data, prefix):
    """Lines "P NNNNN" numbered from 1, then "P END N", as the guest's awk checks
    them: returns (summary dict, notes on what is missing, doubled or garbled)."""
    p = prefix.encode()
    notes = []
    lines = data.split(b"\n")
    tail = lines.pop()  # after the last newline: b"" unless a line was cut short
    if tail:
        lines.append(tail)
    want, good, dup, gap, junk, after, end = 1, 0, 0, 0, 0, 0, -1
    for number, line in enumerate(lines, 1):
        if end >= 0:
            after += 1
            notes.append(f"line {number} after the END line: {line[:60]!r}")
            continue
        m = re.fullmatch(rb"(\S+) END (\d+)", line)
        if m and m.group(1) == p:
            end = int(m.group(2))
            continue
        m = re.fullmatch(rb"(\S+) (\d{5})", line)
        if m and m.group(1) == p and not (number == len(lines) and tail):
            v = int(m.group(2))
            if v == want:
                want, good = want + 1, good + 1
            elif v < want:
                dup += 1
                notes.append(f"line {number}: {line.decode()} again (after {prefix} {want - 1})")
            else:
                gap += v - want
                notes.append(f"line {number}: {line.decode()} follows {prefix} {want - 1}: {v - want} line(s) missing")
                want = v + 1
            continue
        junk += 1
        notes.append(f"line {number}: garbage {line[:60]!r} (after {prefix} {want - 1})")
    if end >= 0 and want - 1 < end:
        gap += end - (want - 1)
        notes.append(f"the last {end - want + 1} line(s) missing: {prefix} {want} to {end}")
    summary = {"lines": len(lines), "good": good, "last": want - 1, "end": end, "missing": gap, "doubled": dup,
               "garbage": junk, "after_end": after, "bytes": len(data)}
    return summary, notes


class HostSerial:
    """The host's end of the serial device (the server's pty): one thread reads it
    all the time (a full pty would stall the device), another writes "h NNNNN"
    lines, `batch` every 0.1 s, at least `min_lines` and on until `stop()`, then
    "h END <count>"."""

    def __init__(self, path, batch, min_lines, max_lines):
        self.fd = os.open(path, os.O_RDWR | os.O_NOCTTY)
        tty.setraw(self.fd)  # the server makes it raw already; no echo, no CR/LF games either way
        self.batch, self.min_lines, self.max_lines = batch, min_lines, max_lines
        self.rx = bytearray()
        self.lock = threading.Lock()
        self.sent = 0
        self.wrote_end = threading.Event()
        self.error = None
        self._stop_writing = threading.Event()
        self._closing = threading.Event()
        self._reader = threading.Thread(target=self._read, name="pty-reader", daemon=True)
        self._reader.start()
        self._writer = None

    def _read(self):
        try:
            while not self._closing.is_set():
                ready, _, _ = select.select([self.fd], [], [], 0.2)
                if ready:
                    data = os.read(self.fd, 65536)
                    with self.lock:
                        self.rx += data
        except OSError as error:
            if not self._closing.is_set():
                self.error = f"reading the pty: {error!r}"

    def _write(self):
        try:
            while True:
                chunk = b"".join(b"h %05d\n" % (self.sent + i) for i in range(1, self.batch + 1))
                view = memoryview(chunk)
                while view:
                    view = view[os.write(self.fd, view):]
                self.sent += self.batch
                if (self.sent >= self.min_lines and self._stop_writing.is_set()) or self.sent >= self.max_lines:
                    break
                time.sleep(0.1)
            end = b"h END %d\n" % self.sent
            view = memoryview(end)
            while view:
                view = view[os.write(self.fd, view):]
            self.wrote_end.set()
        except OSError as error:
            self.error = f"writing the pty after h {self.sent}: {error!r}"

    def start_writing(self):
        self._writer = threading.Thread(target=self._write, name="pty-writer", daemon=True)
        self._writer.start()

    def stop_writing(self):
        self._stop_writing.set()

    def received(self):
        with self.lock:
            return bytes(self.rx)

    def received_lines(self):
        with self.lock:
            return self.rx.count(b"\n")

    def close(self):
        self._closing.set()
        self._reader.join(2)
        try:
            os.close(self.fd)
        except OSError:
            pass


def cut_phase(console, proxy, resumed, seed, busy="write", min_busy=MIN_CUTS_IN_WRITES, doing="writing",
              progress=None):
    """The cuts; raises with what went wrong as soon as something does. Cuts the
    plan through, and on (cycling through it) until at least `min_busy` landed
    while the guest's phase was `busy` (`doing` says it in words); until then
    every odd cut waits for that phase. `resumed()`
    counts the server's "resumed" lines of this phase's session. `progress()`,
    if given, returns (a count that must have grown since the previous cut
    before the next one is made, what it counts). Returns (seconds, cuts by
    guest phase)."""
    rng = random.Random(seed)
    print(f"cutting (seed {seed}): {' '.join(PLAN)}, then on until {min_busy} silent cuts hit {doing}",
          flush=True)
    started = time.time()
    phases = {}
    silent = {}
    k = 0
    last_progress = progress()[0] if progress else None
    while k < len(PLAN) or silent.get(busy, 0) < min_busy:
        if k >= MAX_CUTS:
            raise RuntimeError(f"{k} cuts, only {silent.get(busy, 0)} silent ones while the guest was {doing}")
        k += 1
        mode = PLAN[(k - 1) % len(PLAN)]
        console.sleep(rng.uniform(1.5, 3.0))
        if progress:
            # The session carries data again since the last cut (not just a connection).
            deadline = time.time() + RECONNECT_TIMEOUT
            while progress()[0] <= last_progress and time.time() < deadline and not console.bad:
                console.sleep(0.2)
            count, what = progress()
            if count <= last_progress and not console.bad:
                raise RuntimeError(f"before cut {k}: {what} stuck at {count} for {RECONNECT_TIMEOUT} s "
                                   f"after cut {k - 1}")
            last_progress = count
        if (mode in cutproxy.SILENT_MODES or k % 2 == 1) and silent.get(busy, 0) < min_busy:
            # Aim this cut at the busy phase: wait for it, then a moment into it.
            deadline = time.time() + BUSY_WAIT_SECONDS
            while console.phase[0] not in (busy, "done") and time.time() < deadline and not console.bad:
                console.sleep(0.1)
            if console.phase[0] == busy:
                console.sleep(rng.uniform(0.1, 0.5))
        if console.bad:
            raise RuntimeError(f"before cut {k}: the kernel noticed: {console.bad[0]}")
        if console.phase[0] == "done":
            raise RuntimeError(f"before cut {k}: the guest stopped {doing} before the host was done")
        newest = proxy.stats()["connections"]
        n = proxy.cut(mode)
        phase, now_doing = console.phase
        phases[phase] = phases.get(phase, 0) + 1
        if mode in cutproxy.SILENT_MODES:
            silent[phase] = silent.get(phase, 0) + 1
        print(f"  cut {k:2}: {mode:9} ({n} connection(s)) at +{time.time() - started:5.1f} s; guest: {now_doing}"
              + (f"; {progress()[1]} {progress()[0]}" if progress else ""), flush=True)
        if n == 0:
            raise RuntimeError(f"cut {k} ({mode}): no live connection to cut")
        # The relay reconnects through the proxy and the server resumes the session.
        deadline = time.time() + RECONNECT_TIMEOUT
        conn = None
        while time.time() < deadline and not console.bad:
            conn = conn or proxy.wait_new_connection(newest, 0.2)
            if conn and resumed() >= k:
                break
            console.poll()
        if console.bad:
            raise RuntimeError(f"after cut {k} ({mode}): the kernel noticed: " + " | ".join(console.bad[:3]))
        if conn is None:
            stats = proxy.stats()
            raise RuntimeError(f"after cut {k} ({mode}): no new connection through the proxy within "
                               f"{RECONNECT_TIMEOUT} s ({stats['connections']} so far): nothing reconnected "
                               f"(was the kernel given the TCP socket itself?)")
        if resumed() < k:
            raise RuntimeError(f"after cut {k} ({mode}): connection {conn['id']} came, but the server logged "
                               f"{resumed()} 'resumed' for {k} cuts")
        print(f"      resumed on connection {conn['id']} after {time.time() - proxy.stats()['cut_log'][-1][0]:.1f} s",
              flush=True)
    return time.time() - started, phases, silent


def listen_to_hang_up(sock, port):
    """Listens on `port` and closes every connection at once (the guest's
    "is the host done?" probe)."""
    sock.bind(("127.0.0.1", port))
    sock.listen(4)

    def hang_up():
        try:
            while True:
                conn, _ = sock.accept()
                conn.close()
        except OSError:
            pass

    threading.Thread(target=hang_up, daemon=True).start()


def serial_phase(checks, console, proxy, server_log, busid, link, seed, sdone, sdone_port):
    """Both ways through /dev/ttyACM0 while the host cuts; returns the proxy's
    counts at its start (for the final checks) and whether the cuts went through."""
    console.until("@@SERIAL-PHASE", 90)
    start = {"stats": proxy.stats(), "log": server_log.mark()}
    print(console.until("@@SERIAL-ATTACH-OUT", 90), flush=True)
    host = HostSerial(link, SERIAL_BATCH, MIN_LINES, MAX_LINES)
    try:
        console.until("@@SERIAL-READY", 60)
        host.start_writing()
        t0 = time.time()
        print(f"serial {busid}: streaming both ways ({SERIAL_BATCH} lines every 0.1 s each way, "
              f">= {MIN_LINES}) at {time.time() - console.g.started:.1f} s", flush=True)

        def progress():
            if host.error:
                raise RuntimeError(f"host pty: {host.error}")
            return host.received_lines(), "guest -> host lines"

        took, phases, silent = cut_phase(console, proxy, lambda: len(server_log.resumed(busid, start["log"])),
                                         seed + 1, busy="stream", min_busy=MIN_SILENT_IN_STREAM, doing="streaming",
                                         progress=progress)
        print(f"{sum(phases.values())} cuts in {took:.1f} s; while the guest was: "
              + ", ".join(f"{p} {n}" for p, n in sorted(phases.items())) + f"; silent ones: {silent}", flush=True)
        checks.check(f"serial: >= {MIN_CUTS_IN_STREAM} cuts while both ways were streaming",
                     phases.get("stream", 0) >= MIN_CUTS_IN_STREAM, phases)
        checks.check(f"serial: >= {MIN_SILENT_IN_STREAM} of them silent (server-rst, stall)",
                     silent.get("stream", 0) >= MIN_SILENT_IN_STREAM, silent)
        host.stop_writing()
        listen_to_hang_up(sdone, sdone_port)
        if not host.wrote_end.wait(60):
            raise RuntimeError(f"the host's writer did not finish within 60 s ({host.sent} lines written; "
                               f"{host.error or 'the pty write blocks: the device does not take the bytes'})")
        sent = int(console.until("@@SERIAL-SENT", 90).split()[-1])
        print(f"sent: host {host.sent} lines, guest {sent} lines, in {time.time() - t0:.1f} s", flush=True)
        deadline = time.time() + 60
        while b"g END" not in host.received() and time.time() < deadline:
            console.sleep(0.2)
        console.sleep(1.0)  # whatever might follow the END line arrives too (there must be nothing)
        got = host.received()
        summary, notes = check_lines(got, "g")
        print("host received: " + " ".join(f"{k}={v}" for k, v in summary.items()), flush=True)
        for note in notes[:20]:
            print(f"  {note}", flush=True)
        checks.check("serial: the guest's END line reached the host within 60 s", summary["end"] >= 0,
                     f"{summary['lines']} lines, the last: {got[-40:]!r}")
        checks.check("serial: guest -> host, each line once, in order, no garbage",
                     summary["missing"] == summary["doubled"] == summary["garbage"] == summary["after_end"] == 0,
                     "; ".join(notes[:10]))
        checks.check("serial: guest -> host, all lines", summary["end"] == sent >= MIN_LINES and summary["last"] == sent,
                     f"guest sent {sent}, END says {summary['end']}, in order up to {summary['last']}")
        checks.check("serial: guest -> host, byte count", summary["bytes"] == 8 * sent + len(b"g END %d\n" % sent),
                     f"{summary['bytes']} bytes for {sent} lines and the END line")
        checks.check("serial: host pty reads and writes without error", host.error is None, host.error)
        rx = console.until("@@SERIAL-RX ", 90)
        print(f"guest received: {rx[len('@@SERIAL-RX '):]}", flush=True)
        checks.check("serial: the guest got the host's END line with the host's count",
                     f" end={host.sent} " in rx, f"host sent {host.sent}; {rx}")
        console.until("@@SERIAL-DMESG-BEGIN", 60)
        dmesg = []
        while True:
            line = console.until("", 30)
            if "@@SERIAL-DMESG-END" in line:
                break
            dmesg.append(line)
        console.until("@@SERIAL-DETACHING", 60)
        mark = server_log.mark()
        released = server_log.wait(lambda: any("client disconnected" in line
                                               for line in server_log.text().splitlines()[mark:]), 10)
        checks.check("serial: the server releases the device within 10 s of the detach", released,
                     "server log since the detach:\n    " + "\n    ".join(server_log.text().splitlines()[mark:][-8:]))
        start["detach_log"] = mark
        if any(name.startswith("guest: serial") for name in checks.failed):
            print("guest dmesg in the serial phase:\n  " + "\n  ".join(dmesg[-25:]))
    finally:
        host.close()
    return start


def main():
    guest.require(BIN, MKE2FS)
    guest.build()
    checks = guest.Checks()
    for name, ok, detail in cutproxy.selftest():
        checks.check(name, ok, detail)
    if checks.failed:
        checks.exit()

    work = guest.scratch("usbwire-resume-")
    image = os.path.join(work, "disk.img")
    link = os.path.join(work, "ttyUSBWIRE")
    port = guest.free_port()
    log_path = os.path.join(guest.LOGS, f"{NAME}.server.log")
    server_log_file = open(log_path, "w")
    server = subprocess.Popen(
        [BIN, "serve", "-v", "--listen", f"127.0.0.1:{port}", "--no-advertise",
         "--control", os.path.join(work, "control.sock"),
         "--virtual", f"disk={image},size=128M,speed=super", "--virtual", f"serial={link}"],
        stdout=server_log_file, stderr=subprocess.STDOUT)
    server_log = ServerLog(log_path)
    proxy = cutproxy.CutProxy(("127.0.0.1", port), hole_seconds=HOLE_SECONDS)
    proxy_port = proxy.start()
    done = socket.socket()
    done.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    done_port = guest.free_port()
    sdone = socket.socket()
    sdone.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sdone_port = guest.free_port()
    seed = int(os.environ.get("RESUME_SEED", random.randrange(1 << 30)))
    g = None
    console = None
    cut_ok = False
    before_detach = None  # server log lines up to the disk's detach
    disk_stats = None  # the proxy's counts then
    serial = None  # the serial phase's start (proxy counts, server log line) and detach
    try:
        for _ in range(100):
            if subprocess.run([BIN, "list", "-r", f"127.0.0.1:{port}"], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"server did not come up; log: {log_path}")
        found = re.search(r'exported busid=(\S+) kind="serial"', server_log.text())
        if not found or not os.path.exists(link):
            raise RuntimeError(f"the server exports no serial device with a pty at {link}; log: {log_path}")
        serial_busid = found.group(1)
        script = (GUEST_SCRIPT.replace("__PROXY__", str(proxy_port)).replace("__DONE__", str(done_port))
                  .replace("__MAXPASS__", str(MAX_CUTS))
                  .replace("__SBUS__", serial_busid).replace("__SDONE__", str(sdone_port))
                  .replace("__BATCH__", str(SERIAL_BATCH)).replace("__MINL__", str(MIN_LINES))
                  .replace("__MAXL__", str(MAX_LINES)))
        g = guest.Guest(NAME, script, files={BIN: "/usr/bin/usbwire", MKE2FS: "/usr/sbin/mkfs.ext4",
                                             "/etc/mke2fs.conf": "/etc/mke2fs.conf"}, timeout=480)
        console = Console(g, checks)
        console.until("@@BOOTED", 120)
        print(f"booted in {time.time() - g.started:.1f} s", flush=True)
        print(console.until("@@ATTACH-OUT", 90), flush=True)
        print(console.until("@@RELAY", 30), flush=True)
        disk = console.until("@@DISK ", 60).split()[-1]
        console.until("@@WRITE-START", 150)
        print(f"write started at {time.time() - g.started:.1f} s (disk {disk})", flush=True)

        took, phases, silent = cut_phase(console, proxy, lambda: len(server_log.resumed("0-1")), seed)
        cut_ok = True
        print(f"{sum(phases.values())} cuts in {took:.1f} s; while the guest was: "
              + ", ".join(f"{p} {n}" for p, n in sorted(phases.items())) + f"; silent ones: {silent}", flush=True)
        checks.check(f">= {MIN_CUTS_IN_WRITES} silent cuts (server-rst, stall) while the guest was writing",
                     silent.get("write", 0) >= MIN_CUTS_IN_WRITES, silent)
        # Tell the guest to stop after its current pass.
        listen_to_hang_up(done, done_port)
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
        disk_stats = proxy.stats()
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
        if any(name.startswith("guest") for name in checks.failed):
            print("guest dmesg (usb/scsi/ext4/errors):\n  " + "\n  ".join(dmesg[-25:]))

        serial = serial_phase(checks, console, proxy, server_log, serial_busid, link, seed, sdone, sdone_port)

        end = console.until("@@END", 60)
        checks.check("guest: no failed check", end.strip().endswith("fails=0"), end)
        rc = g.finish(60)
        checks.check("guest script exit code", rc == 0, str(rc))
        print(f"guest ran {time.time() - g.started:.1f} s", flush=True)
    except Exception as error:  # a wait that timed out is a failure with a reason
        checks.check("test ran to the end", False, str(error))
        if console and console.kmsg:
            print("last kernel messages from the guest:\n  " + "\n  ".join(console.kmsg[-15:]))
        print("server log (last lines):\n    " + server_log.tail(12))
    finally:
        if g:
            g.kill()
        done.close()
        sdone.close()
        stats = proxy.stats()
        proxy.stop()
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
        server_log_file.close()

    disk_stats = disk_stats or stats
    # The disk session's life before its detach (after it, the server may hold it for a resume).
    cut_log = ServerLog(log_path, before_detach)
    resumed = cut_log.resumed("0-1")
    print(f"disk: proxy {disk_stats['connections']} connections, {disk_stats['cuts']} cuts; server: "
          f"{len(resumed)} resumed", flush=True)
    serial_from = serial["stats"]["connections"] if serial else len(stats["conns"])
    for c in stats["conns"]:
        print(f"  connection {c['id']:2}{' (serial)' if c['id'] > serial_from else '         '}: {c['up']:>10} B up, "
              f"{c['down']:>10} B down, ended by {c['ended_by'] or '-'}")
    if cut_ok:
        checks.check("proxy made >= 10 cuts", disk_stats["cuts"] >= 10, disk_stats["cuts"])
        checks.check("proxy saw >= 11 connections", disk_stats["connections"] >= 11, disk_stats["connections"])
        checks.check("server logged 'resumed' for every cut", len(resumed) >= disk_stats["cuts"],
                     f"{len(resumed)} for {disk_stats['cuts']} cuts")
        checks.check("server never gave up on the session", cut_log.count("not resumed within") == 0
                     and cut_log.count("resume refused") == 0,
                     "\n    ".join(line for line in cut_log.text().splitlines()
                                   if "not resumed" in line or "resume refused" in line))
    if serial and "detach_log" in serial:
        lines = ServerLog(log_path).text().splitlines()[serial["log"]:serial["detach_log"]]
        s_cuts = stats["cuts"] - serial["stats"]["cuts"]
        s_conns = stats["connections"] - serial["stats"]["connections"]
        s_resumed = ServerLog(log_path, serial["detach_log"]).resumed(serial_busid, serial["log"])
        print(f"serial: proxy {s_conns} connections, {s_cuts} cuts; server: {len(s_resumed)} resumed", flush=True)
        checks.check("serial: proxy made >= 10 cuts", s_cuts >= 10, s_cuts)
        checks.check("serial: proxy saw a connection more than cuts", s_conns >= s_cuts + 1,
                     f"{s_conns} connections, {s_cuts} cuts")
        checks.check("serial: server logged 'resumed' for every cut", len(s_resumed) >= s_cuts,
                     f"{len(s_resumed)} for {s_cuts} cuts")
        checks.check("serial: server never gave up on the session",
                     not any("not resumed" in line or "resume refused" in line for line in lines),
                     "\n    ".join(line for line in lines if "not resumed" in line or "resume refused" in line))
    checks.check("server refused no import", server_log.count("import refused") == 0,
                 "\n    ".join(l for l in server_log.text().splitlines() if "import refused" in l))
    if checks.failed:
        print(f"logs: {g.console_path if g else ''} {log_path}")
    checks.exit()


if __name__ == "__main__":
    main()
