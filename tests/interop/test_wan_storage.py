#!/usr/bin/env python3
"""A disk over a long link (50 ms round trip): the storage accelerator of
`usbwire attach` keeps every byte right, the server still serves the kernel's
own client, and what each way costs is printed.

Host: `usbwire serve --virtual disk=IMAGE,size=64M` on loopback, reached only
through cutproxy.py with a 25 ms delay in each direction (bytes never
reordered). Guest (Debian's kernel with vhci-hcd under QEMU) imports the disk
through the proxy three times, one after the other:

  accelerated  `usbwire attach -r 10.0.2.2:PROXY -b BUSID` (--accelerate auto)
  off          `usbwire attach --accelerate off ...`
  stock        Debian's `usbip --tcp-port PROXY attach -r 10.0.2.2 -b BUSID`
               (the kernel takes the socket itself)

Each time it checks, on the raw device:
  - from the second import on, the files an earlier import wrote into the
    filesystem read back with their sha256 (what one client wrote, the next
    reads);
  - 16 MiB read and 2 MiB of random data written with O_DIRECT (`dd
    iflag=direct` / `oflag=direct`, beyond the filesystem), timed, and the
    written range read back equal;
  - reads right after an overwrite of a range just read return the new
    bytes (1 MiB in one piece, then 64 KiB in 4 KiB pieces), and before it
    the range held what the previous import wrote there;
  - around the disk's bad blocks (`bad=`: 8 blocks at 60 MiB whose reads fail
    with MEDIUM ERROR): 4 MiB read sequentially up to them (and, accelerated,
    read ahead into them) come back without an error and with the image's
    bytes; a read of one fails, with the same kernel errors in every mode;
    a read after that works;
  - a second disk (on a server of its own, behind a delaying proxy of its own), streamed
    with O_DIRECT, goes away 2 MiB in (its server stops and ends its sessions, as a
    server whose device was unplugged does; accelerated, reads ahead are in flight): the
    stream ends early with an error, every byte it read is the image's, the kernel logs
    the disconnect and no bug, warning or hung task (its lines are printed per mode);
and, accelerated and stock, through a filesystem: ext4 made with Debian's
mkfs.ext4 on the first 32 MiB, three files (3 MiB random among them) written
and synced, unmounted, caches dropped, mounted again: the sha256s match;
`e2fsck -fn` finds it clean. Then detach: the disk goes, the relay ends. At
the end dmesg has no I/O error, ext4 error or URB given back twice.
The host checks that the server logged `storage=true descriptors=true` for
the accelerated import and `storage=false` for the one with it off (whose relay
says nothing of mass storage), that the accelerated relay's lines count
commands_pipelined > 0 and descriptors answered from the snapshot, and, once
the server stopped, that the files of the last filesystem are in the disk's
image with the guest's sha256s (debugfs).

The speeds and the time from attach to the kernel's "Attached SCSI" line are
printed as a table with the accelerated-to-stock ratio; nothing is asserted
about them (a TCG guest on a shared machine is no benchmark). About 3.5 minutes.

Run: python3 tests/interop/test_wan_storage.py   (USBWIRE_BIN=path/to/usbwire)
"""

import hashlib
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cutproxy  # noqa: E402
import guest  # noqa: E402

BIN = guest.BIN
# Each way; 50 ms round trip.
DELAY = 0.025
MODES = ("accelerated", "off", "stock")
# The disk's bad blocks (60 MiB in): reads of them fail with MEDIUM ERROR.
BAD_BLOCKS = "122880-122887"
# Debian's e2fsprogs in the guest (busybox's mke2fs makes only ext2 and has no fsck).
E2FS = {"/usr/sbin/mkfs.ext4": "/usr/sbin/mkfs.ext4", "/usr/sbin/e2fsck": "/usr/sbin/e2fsck",
        "/etc/mke2fs.conf": "/etc/mke2fs.conf"}

# The guest's shell functions (test_wan_storage_real.py uses them too): `attach`, `uses`
# (the checks on an attached disk) and `detach`, each printing @@CHECK and @@TIME lines.
FUNCTIONS = r"""
set -u
RELAY_LOG=/var/run/vhci_hcd/usbwire-relay.log
ln -sf /proc/mounts /etc/mtab
now() { cut -d' ' -f1 /proc/uptime; }
since() { awk "BEGIN { printf \"%.3f\", $(now) - $1 }"; }
# The files of the filesystem round trip, in tmpfs, with their sha256s.
mkdir -p /tmp/files/sub
head -c 3145728 /dev/urandom > /tmp/files/random.bin
head -c 65536 /dev/urandom > /tmp/files/sub/small.bin
echo "a disk over a long link" > /tmp/files/sub/note.txt
(cd /tmp/files && sha256sum random.bin sub/small.bin sub/note.txt) > /tmp/files.sha256
sed 's/^/@@SHA256 /' /tmp/files.sha256
# What the disk holds where the overwrite checks write, beyond the 32 MiB filesystem
# (zeros on the new disk).
head -c 1048576 /dev/zero > /tmp/held1m
head -c 65536 /dev/zero > /tmp/held64k
FIRST=1

scsi_lines() { dmesg | grep -c "Attached SCSI"; }
disk_name() { for d in /sys/block/sd*; do [ -e "$d" ] && basename "$d" && return 0; done; return 1; }

# attach MODE COMMAND...: attaches with COMMAND (tried again while the server still
# holds the previous import), then waits for the kernel's "Attached SCSI" and sets DEV.
attach() {
  mode=$1; shift
  before=$(scsi_lines)
  tries=0
  while :; do
    t0=$(now)
    "$@" > /tmp/attach.out 2>&1 && break
    tries=$((tries+1))
    if [ $tries -ge 40 ]; then check $mode-attach 1 "$(cat /tmp/attach.out)"; return 1; fi
    sleep 0.5
  done
  check $mode-attach 0
  cat /tmp/attach.out
  wait_for '[ $(scsi_lines) -gt $before ]' 600; rc=$?
  check $mode-disk-appears $rc
  [ $rc = 0 ] || return 1
  t1=$(dmesg | grep "Attached SCSI" | tail -n 1 | sed 's/^\[ *\([0-9.]*\)\].*/\1/')
  echo "@@TIME $mode attached $(awk "BEGIN { printf \"%.3f\", $t1 - $t0 }") 0"
  DEV=/dev/$(disk_name)
  wait_path $DEV 100; check $mode-device-node $? "$DEV"
  # The command size: an accelerated usbwire disk's is raised to 1 MiB by the relay, soon after.
  q=/sys/block/$(disk_name)/queue/max_sectors_kb
  [ $mode != accelerated ] || wait_for "[ \"\$(cat $q)\" = 1024 ]" 100
  echo "@@LIMITS $mode $(cat $q)"
}

# timed NAME BYTES COMMAND...: runs COMMAND (a dd), checks its exit code, prints the time.
timed() {
  name=$1; bytes=$2; shift 2
  t0=$(now)
  "$@" 2> /tmp/dd.err; rc=$?
  took=$(since $t0)
  check $name $rc "$(cat /tmp/dd.err)"
  echo "@@TIME ${name%%-*} ${name#*-} $took $bytes"
}

previous_files() {
  mode=$1
  mount -t ext4 -o ro $DEV /mnt && (cd /mnt && sha256sum -c /tmp/files.sha256) > /tmp/sum.out 2>&1; rc=$?
  umount /mnt 2>/dev/null
  check $mode-reads-previous-files $rc "$(cat /tmp/sum.out 2>/dev/null)"
}

speeds() {
  mode=$1
  echo 3 > /proc/sys/vm/drop_caches
  timed $mode-read 16777216 dd if=$DEV of=/dev/null bs=1M count=16 iflag=direct
  head -c 2097152 /dev/urandom > /tmp/new2m
  timed $mode-write 2097152 dd if=/tmp/new2m of=$DEV bs=1M count=2 seek=32 oflag=direct
  dd if=$DEV of=/tmp/back2m bs=1M count=2 skip=32 iflag=direct 2>/dev/null && cmp /tmp/new2m /tmp/back2m
  check $mode-written-range-reads-back $?
}

# overwrite MODE BS COUNT AT HELD: reads COUNT blocks of BS at block AT, overwrites them
# with new random bytes, reads them again: the new bytes, and before them HELD's.
overwrite() {
  mode=$1; bs=$2; count=$3; at=$4; held=$5
  size=$((bs * count))
  head -c $size /dev/urandom > /tmp/new
  dd if=$DEV of=/tmp/before bs=$bs count=$count skip=$at iflag=direct 2>/dev/null
  cmp -s /tmp/before $held; check $mode-range-held-previous-bytes-$size $? "$(cmp /tmp/before $held 2>&1)"
  dd if=/tmp/new of=$DEV bs=$bs count=$count seek=$at oflag=direct 2>/dev/null; w=$?
  dd if=$DEV of=/tmp/after bs=$bs count=$count skip=$at iflag=direct 2>/dev/null; r=$?
  [ $w = 0 ] && [ $r = 0 ] && cmp /tmp/after /tmp/new > /tmp/cmp.out 2>&1 && ! cmp -s /tmp/before /tmp/new
  check $mode-read-after-overwrite-returns-new-bytes-$size $? "dd write $w read $r; $(cat /tmp/cmp.out)"
  cp /tmp/new $held
}

filesystem() {
  mode=$1
  t0=$(now)
  /usr/sbin/mkfs.ext4 -q -F $DEV 32M > /tmp/mkfs.out 2>&1; check $mode-mkfs-ext4 $? "$(cat /tmp/mkfs.out)"
  mount -t ext4 $DEV /mnt; check $mode-mount $?
  cp -r /tmp/files/. /mnt/ && sync; check $mode-files-written $?
  umount /mnt; check $mode-umount $?
  echo 3 > /proc/sys/vm/drop_caches
  mount -t ext4 $DEV /mnt && (cd /mnt && sha256sum -c /tmp/files.sha256) > /tmp/sum.out 2>&1
  check $mode-files-read-back-same-sha256 $? "$(cat /tmp/sum.out)"
  umount /mnt
  /usr/sbin/e2fsck -fn $DEV > /tmp/fsck.out 2>&1; check $mode-fsck-clean $? "$(tail -n 5 /tmp/fsck.out)"
  echo "@@TIME $mode filesystem $(since $t0) 0"
}

# uses MODE [fs]: the checks on the raw device; with `fs` the filesystem round trip too.
uses() {
  mode=$1
  [ $FIRST = 1 ] || previous_files $mode
  FIRST=0
  speeds $mode
  overwrite $mode 1048576 1 40 /tmp/held1m
  overwrite $mode 4096 16 12288 /tmp/held64k
  [ "${2:-}" = fs ] && filesystem $mode
  return 0
}

# detach MODE TOOL: detaches the disk's port with TOOL (usbwire or usbip), waits for the
# disk and any relay to go, and prints the relay's log.
detach() {
  mode=$1; tool=$2
  port=$(usbwire port --json | tr ',{}' '\n\n\n' | sed -n 's/.*"port":\([0-9]*\).*/\1/p' | head -n 1)
  [ $tool = usbwire ] && usbwire port --prometheus | sed "s/^/@@PROM $mode /"
  $tool detach -p "$port" > /tmp/detach.out 2>&1; check $mode-detach $? "$(cat /tmp/detach.out)"
  wait_gone $DEV; check $mode-disk-gone $?
  wait_for '! pidof usbwire > /dev/null' 300; check $mode-relay-ended $? "$(ps | grep '[u]sbwire')"
  [ -e $RELAY_LOG ] && sed "s/^/@@RELAYLOG $mode /" $RELAY_LOG
  rm -f $RELAY_LOG
}

# faults MODE: around the disk's bad blocks (LBA 122880-122887, 60 MiB in): a sequential
# stream that ends right before them (read ahead into them when accelerated) reads without
# an error and prints its sha256; a read of one fails, and the kernel logs a medium error
# (the lines, and only those, are left out of dmesg_clean); a read after it works.
touch /tmp/fault.lines
faults() {
  mode=$1
  echo 3 > /proc/sys/vm/drop_caches
  dd if=$DEV of=/tmp/stream bs=1M count=4 skip=56 iflag=direct 2> /tmp/dd.err
  check $mode-stream-before-bad-blocks-reads $? "$(cat /tmp/dd.err)"
  echo "@@FAULTSHA $mode $(sha256sum < /tmp/stream | cut -d' ' -f1)"
  before=$(dmesg | wc -l)
  dd if=$DEV of=/dev/null bs=4096 count=1 skip=15360 iflag=direct 2> /tmp/dd.err
  [ $? != 0 ]; check $mode-read-of-a-bad-block-fails $? "$(cat /tmp/dd.err)"
  sleep 1
  dmesg | tail -n +$((before + 1)) > /tmp/fault-$mode.log
  cat /tmp/fault-$mode.log >> /tmp/fault.lines
  sed "s/^/@@FAULTLOG $mode /" /tmp/fault-$mode.log
  grep -q "Medium Error" /tmp/fault-$mode.log && grep -q "Unrecovered read error" /tmp/fault-$mode.log
  check $mode-kernel-logs-a-medium-error $? "$(cat /tmp/fault-$mode.log)"
  dd if=$DEV of=/tmp/again bs=1M count=1 skip=59 iflag=direct 2> /tmp/dd.err && \
    cmp /tmp/again /tmp/stream 0 3145728 >> /tmp/dd.err 2>&1
  check $mode-reads-after-the-error $? "$(cat /tmp/dd.err)"
}

# unplug MODE COMMAND...: attaches the mode's second disk with COMMAND, streams it with
# O_DIRECT and, 2 MiB in (accelerated: with reads ahead in flight), asks the host to take it
# away (@@UNPLUG): the read ends, the disk and its relay go, and what was read is printed
# (@@UNPLUGGED: dd's exit code, bytes, sha256) with the kernel's lines meanwhile.
unplug() {
  mode=$1; shift
  before=$(scsi_lines)
  "$@" > /tmp/attach2.out 2>&1; check $mode-unplug-disk-attach $? "$(cat /tmp/attach2.out)"
  wait_for '[ $(scsi_lines) -gt $before ]' 600; check $mode-unplug-disk-appears $?
  U=""
  for d in /sys/block/sd*; do [ /dev/$(basename $d) != $DEV ] && U=/dev/$(basename $d); done
  wait_path "$U" 100; check $mode-unplug-disk-node $? "$U"
  echo 3 > /proc/sys/vm/drop_caches
  mark=$(dmesg | wc -l)
  dd if=$U of=/tmp/partial bs=1M iflag=direct 2> /tmp/unplug.err & pid=$!
  # 2 MiB in (a slow guest may take seconds for them; accelerated, reads ahead are in flight by then).
  wait_for '[ $(stat -c %s /tmp/partial 2>/dev/null || echo 0) -ge 2097152 ]' 600
  echo "@@UNPLUG $mode"
  wait $pid; rc=$?
  wait_gone $U; check $mode-unplugged-disk-gone $?
  echo "@@UNPLUGGED $mode $rc $(stat -c %s /tmp/partial) $(sha256sum < /tmp/partial | cut -d' ' -f1)"
  sleep 1
  dmesg | tail -n +$((mark + 1)) > /tmp/unplug-$mode.log
  cat /tmp/unplug-$mode.log >> /tmp/fault.lines
  sed "s/^/@@UNPLUGLOG $mode /" /tmp/unplug-$mode.log
  rm -f /tmp/partial
}

dmesg_clean() {
  if [ -s /tmp/fault.lines ]; then dmesg | grep -vxF -f /tmp/fault.lines; else dmesg; fi > /tmp/dmesg.out
  ! grep -iE "I/O error|EXT4-fs error|given back|critical medium|device reset" /tmp/dmesg.out > /tmp/bad.out
  check dmesg-clean $? "$(head -n 5 /tmp/bad.out)"
  echo "@@DMESG-BEGIN"; grep -iE "usb|scsi|sd[a-z]|ext4|vhci" /tmp/dmesg.out | tail -n 200; echo "@@DMESG-END"
}
"""

SCRIPT = FUNCTIONS + r"""
S=10.0.2.2:__PORT__
BUSID=__BUSID__
echo "@@MODE accelerated"
attach accelerated usbwire attach -r $S -b $BUSID && uses accelerated fs && faults accelerated && \
  unplug accelerated usbwire attach -r 10.0.2.2:__UNPLUG_accelerated__ -b 0-1
detach accelerated usbwire
echo "@@MODE off"
attach off usbwire attach --accelerate off -r $S -b $BUSID && uses off && faults off && \
  unplug off usbwire attach --accelerate off -r 10.0.2.2:__UNPLUG_off__ -b 0-1
detach off usbwire
echo "@@MODE stock"
attach stock usbip --tcp-port __PORT__ attach -r 10.0.2.2 -b $BUSID && uses stock fs && faults stock && \
  unplug stock usbip --tcp-port __UNPLUG_stock__ attach -r 10.0.2.2 -b 0-1
detach stock usbip
dmesg_clean
echo "@@END"
exit 0
"""

# The guest's checks: in every mode ("previous files" from the second on), the
# filesystem round trip in all but "off", then once.
PER_MODE = ["attach", "disk-appears", "device-node", "read", "write", "written-range-reads-back",
            "range-held-previous-bytes-1048576", "read-after-overwrite-returns-new-bytes-1048576",
            "range-held-previous-bytes-65536", "read-after-overwrite-returns-new-bytes-65536",
            "detach", "disk-gone", "relay-ended"]
FAULTS = ["stream-before-bad-blocks-reads", "read-of-a-bad-block-fails", "kernel-logs-a-medium-error",
          "reads-after-the-error", "unplug-disk-attach", "unplug-disk-appears", "unplug-disk-node",
          "unplugged-disk-gone"]
FILESYSTEM = ["mkfs-ext4", "mount", "files-written", "umount", "files-read-back-same-sha256", "fsck-clean"]
EXPECTED = [f"{mode}-{name}" for mode in MODES for name in PER_MODE + FAULTS] + \
    [f"{mode}-{name}" for mode in ("accelerated", "stock") for name in FILESYSTEM] + \
    [f"{mode}-reads-previous-files" for mode in MODES[1:]] + ["dmesg-clean"]


def busid_of_the_disk(port, server):
    """The bus id `usbwire list -r` shows for the server's one device, once it answers."""
    deadline = time.time() + 30
    while time.time() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"usbwire serve exited with {server.returncode}")
        out = subprocess.run([BIN, "list", "-r", f"127.0.0.1:{port}", "--json"], capture_output=True, text=True)
        if out.returncode == 0:
            devices = json.loads(out.stdout)["devices"]
            if len(devices) == 1:
                return devices[0]["busid"]
            raise RuntimeError(f"expected one device, the server lists {devices}")
        time.sleep(0.2)
    raise RuntimeError("usbwire serve did not answer `list -r` within 30 s")


def read_console(g, checks, expected, on_line=None):
    """Every line up to @@END: the guest's checks (each of `expected` must be there),
    timings ({(mode, what): (seconds, bytes)}), relay logs ({mode: text}), the sha256s
    of the files it writes into filesystems ({path: hex}) and what `faults` printed
    ({"sha": {mode: hex}, "log": {mode: kernel lines}, "unplugged": {mode: (rc, bytes, hex)},
    "unplug_log": {mode: kernel lines}}), `usbwire port --prometheus` before each detach
    ({"prometheus": {mode: text}}) and each disk's max_sectors_kb ({"limits": {mode: KiB}}). `on_line` sees every line first."""
    seen, times, relay, sums = {}, {}, {}, {}
    faults = {"sha": {}, "log": {}, "unplugged": {}, "unplug_log": {}, "prometheus": {}, "limits": {}}
    while True:
        line = g.wait_for("", 480)
        if on_line:
            on_line(line)
        if "@@END" in line:
            break
        if "@@CHECK " in line:
            parts = line.split("@@CHECK ", 1)[1].split(" ", 2)
            name, ok = parts[0], len(parts) > 1 and parts[1] == "PASS"
            seen[name] = ok
            checks.check(f"guest: {name}", ok, line)
        elif "@@TIME " in line:
            mode, what, seconds, size = line.split("@@TIME ", 1)[1].split()
            times[(mode, what)] = (float(seconds), int(size))
        elif "@@RELAYLOG " in line:
            mode, text = line.split("@@RELAYLOG ", 1)[1].split(" ", 1)
            relay[mode] = relay.get(mode, "") + text + "\n"
        elif "@@FAULTSHA " in line:
            mode, digest = line.split("@@FAULTSHA ", 1)[1].split()
            faults["sha"][mode] = digest
        elif "@@UNPLUGGED " in line:
            mode, rc, size, digest = line.split("@@UNPLUGGED ", 1)[1].split()
            faults["unplugged"][mode] = (int(rc), int(size), digest)
        elif "@@UNPLUGLOG " in line:
            mode, text = (line.split("@@UNPLUGLOG ", 1)[1].split(" ", 1) + [""])[:2]
            faults["unplug_log"][mode] = faults["unplug_log"].get(mode, "") + text + "\n"
        elif "@@FAULTLOG " in line:
            mode, text = (line.split("@@FAULTLOG ", 1)[1].split(" ", 1) + [""])[:2]
            faults["log"][mode] = faults["log"].get(mode, "") + text + "\n"
        elif "@@PROM " in line:
            mode, text = (line.split("@@PROM ", 1)[1].split(" ", 1) + [""])[:2]
            faults["prometheus"][mode] = faults["prometheus"].get(mode, "") + text + "\n"
        elif "@@LIMITS " in line:
            mode, kib = line.split("@@LIMITS ", 1)[1].split()
            faults["limits"][mode] = int(kib)
        elif "@@SHA256 " in line:
            digest, path = line.split("@@SHA256 ", 1)[1].split()
            sums[path] = digest
    missing = [name for name in expected if name not in seen]
    checks.check("the guest ran every check", not missing, f"missing: {missing}")
    return times, relay, sums, faults


def image_holds_files(checks, image, sums, what):
    """The files the guest wrote last are in `image` (its filesystem read on the host with
    debugfs), with the sha256s the guest printed."""
    checks.check(f"{what}: the guest printed the sha256s of its files", len(sums) == 3, sums)
    for path, digest in sums.items():
        out = subprocess.run(["debugfs", "-R", f"cat /{path}", image], capture_output=True)
        got = hashlib.sha256(out.stdout).hexdigest()
        checks.check(f"{what}: /{path} has the guest's sha256 (debugfs on the host)", got == digest,
                     f"{got} {out.stderr.decode(errors='replace')[-300:]}")


def print_table(times, modes=MODES, what="USB mass storage"):
    """The speeds and times the guest printed, one row per mode, and accelerated against
    stock when both ran."""
    def speed(mode, what):
        seconds, size = times.get((mode, what), (0, 0))
        return size / seconds / (1 << 20) if seconds > 0 else float("nan")

    print(f"\n{what} over a {2 * DELAY * 1000:.0f} ms round trip (TCG guest; printed, not asserted):")
    print(f"{'mode':<12} {'read MiB/s':>10} {'write MiB/s':>11} {'s to Attached SCSI':>19} {'fs round trip s':>16}")
    for mode in modes:
        attached = times.get((mode, "attached"), (float("nan"), 0))[0]
        fs = times.get((mode, "filesystem"), (float("nan"), 0))[0]
        print(f"{mode:<12} {speed(mode, 'read'):>10.2f} {speed(mode, 'write'):>11.2f} {attached:>19.2f} {fs:>16.1f}")
    if "accelerated" in modes and "stock" in modes:
        ratios = []
        for what in ("read", "write"):
            stock = speed("stock", what)
            ratios.append(f"{what} {speed('accelerated', what) / stock:.1f}x" if stock > 0 else f"{what} n/a")
        stock_fs = times.get(("stock", "filesystem"), (0, 0))[0]
        accelerated_fs = times.get(("accelerated", "filesystem"), (0, 0))[0]
        if accelerated_fs > 0:
            ratios.append(f"filesystem round trip {stock_fs / accelerated_fs:.1f}x faster")
        print("accelerated / stock: " + ", ".join(ratios))
    print(flush=True)


def relay_pipelined(checks, relay_log, who):
    """Checks the relay's "mass storage accelerated" line counts commands_pipelined > 0."""
    line = re.search(r"mass storage accelerated.*", relay_log)
    counts = dict(re.findall(r"(\w+)=(\d+)", line.group(0))) if line else {}
    print(f"relay ({who}): {line.group(0) if line else 'no mass storage accelerated line'}")
    checks.check(f"the {who} relay pipelined commands (commands_pipelined > 0)",
                 int(counts.get("commands_pipelined", 0)) > 0, relay_log[-1500:] or "no relay log")


def port_metrics(checks, text):
    """`usbwire port --prometheus` while the accelerated disk was attached: promtool accepts
    it, and it counts what the accelerator did."""
    lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    checks.check("promtool check metrics accepts `usbwire port --prometheus`", lint.returncode == 0,
                 lint.stdout + lint.stderr + text[-1500:])
    # The scan ahead answered the kernel's scan of the new disk (INQUIRY, READ CAPACITY, …).
    for metric in ("usbwire_port_storage_commands_pipelined_total", "usbwire_port_storage_read_ahead_hits_total",
                   "usbwire_port_storage_scan_ahead_hits_total"):
        sample = re.search(rf"^{metric}{{port=\"\d+\",server=\"10\.0\.2\.2:\d+\",busid=\"[^\"]+\"}} (\d+)$", text, re.M)
        checks.check(f"`usbwire port --prometheus` has the accelerated disk's {metric} > 0",
                     sample is not None and int(sample.group(1)) > 0, text[-1500:] or "nothing printed")
    connected = re.search(r"^usbwire_port_relay_connected\{.*\} 1$", text, re.M)
    checks.check("`usbwire port --prometheus` has the relay connected", connected is not None, text[-1500:])


def make_image(image):
    """The 64 MiB image, with random bytes where `faults` streams (56-60 MiB, right before the
    bad blocks): their sha256."""
    stream = os.urandom(4 << 20)
    with open(image, "wb") as f:
        f.truncate(64 << 20)
        f.seek(56 << 20)
        f.write(stream)
    return hashlib.sha256(stream).hexdigest()


def kernel_errors(log):
    """The kernel's error lines of a fault, without what differs from one run to the next
    (times, tags, command ages)."""
    lines = set()
    for line in log.splitlines():
        line = re.sub(r"^\[[ 0-9.]*\] ", "", line)
        line = re.sub(r"tag#\d+ ", "", re.sub(r" cmd_age=\S+", "", line))
        if re.search(r"Sense|medium error|I/O error|FAILED Result", line):
            lines.add(line.strip())
    return lines


def faults_as_local(checks, faults, stream):
    """Every mode read the image's own bytes up to the bad blocks, and the kernel logged
    the same errors for the bad block with the accelerator as without it."""
    for mode in MODES:
        checks.check(f"{mode}: the stream up to the bad blocks read the image's bytes",
                     faults["sha"].get(mode) == stream, (faults["sha"].get(mode), stream))
    logs = {mode: kernel_errors(faults["log"].get(mode, "")) for mode in MODES}
    for mode in MODES:
        print(f"kernel on the bad block ({mode}):")
        for line in sorted(logs[mode]):
            print(f"  {line}")
    checks.check("the kernel logged the same errors for the bad block, accelerated and not",
                  bool(logs["accelerated"]) and logs["accelerated"] == logs["off"] == logs["stock"], logs)


# Each mode's second disk, withdrawn from the server while the guest streams it.
UNPLUG_BYTES = 64 << 20
UNPLUG_RANDOM = 32 << 20


def make_unplug_image(path):
    """A disk whose first 32 MiB are random, the rest zeros (a stream reads well into it
    before its disk goes): its bytes, to check what the guest read against."""
    data = os.urandom(UNPLUG_RANDOM) + bytes(UNPLUG_BYTES - UNPLUG_RANDOM)
    with open(path, "wb") as f:
        f.write(data)
    return data


# Kernel lines about a dead device that appear or not with the timing of the next request:
# SCSI's refusal of a request sent after the device went, and the block layer's report of
# it ("device offline error" on 6.x kernels, "I/O error" on older ones).
TIMING_DEPENDENT = r"rejecting I/O to dead device|I/O error|device offline error"


def unplug_kernel_lines(log):
    """The kernel's lines about a disk going away, without what differs from one run to the
    next (times, device numbers, sectors, counts)."""
    lines = set()
    for line in log.splitlines():
        line = re.sub(r"^\[[ 0-9.]*\] ", "", line)
        if re.search(r"disconnect|I/O error|rejecting|Result:|offline|removed", line):
            lines.add(re.sub(r"\b(sd[a-z]+|\d+(-\d+)*)\b", "N", line).strip())
    return lines


def unplugs_as_local(checks, faults, images):
    """In every mode the stream of a disk withdrawn mid-read ended early, every
    byte it read was the image's, and the kernel saw the device go and nothing worse."""
    for mode in MODES:
        rc, size, digest = faults["unplugged"].get(mode, (None, 0, ""))
        image = images[mode]
        # A read on its way as the disk goes fails (an I/O error); one made after the kernel
        # removed the disk meets a device of size 0 (the end of the device). Which one dd
        # sees depends on where the server's last replies leave it: an accelerated disk's
        # 1 MiB command is one whole dd block, so its stream may end between two blocks.
        between_blocks = rc == 0 and size % (1 << 20) == 0
        checks.check(f"{mode}: the stream of the withdrawn disk ended early, with an I/O error or between two blocks",
                     rc is not None and (rc != 0 or between_blocks) and size < UNPLUG_BYTES, (rc, size))
        checks.check(f"{mode}: it read the image's bytes up to where it stopped ({size} bytes)",
                     0 < size <= len(image) and hashlib.sha256(image[:size]).hexdigest() == digest, (size, digest))
        log = faults["unplug_log"].get(mode, "")
        checks.check(f"{mode}: the kernel saw the device disconnect", "USB disconnect" in log, log[-1500:])
        bad = [line for line in log.splitlines() if re.search(r"BUG|Oops|WARNING:|hung_task|blocked for more", line)]
        checks.check(f"{mode}: no kernel bug, warning or hung task as the disk went", not bad, bad)
        print(f"kernel as the disk went ({mode}, read {size} bytes, dd exit {rc}):")
        for line in sorted(unplug_kernel_lines(log)):
            print(f"  {line}")
    # Whether a request of the stream meets the dead device ("rejecting I/O to dead device",
    # an I/O error line) depends on when it was sent: a faster stream is likelier to.
    lines = {mode: {line for line in unplug_kernel_lines(faults["unplug_log"].get(mode, ""))
                    if not re.search(TIMING_DEPENDENT, line)} for mode in MODES}
    checks.check("the kernel logged the same lines as the disk went, accelerated and not",
                 bool(lines["accelerated"]) and lines["accelerated"] == lines["off"] == lines["stock"], lines)


def main():
    guest.require(BIN)
    guest.build()
    checks = guest.Checks()
    # The proxy's own self-test first (its delay and order among the rest): a few seconds.
    for name, ok, detail in cutproxy.selftest():
        checks.check(name, ok, detail)
    if checks.failed:
        checks.exit()
    work = guest.scratch("usbwire-wan-")
    image = os.path.join(work, "disk.img")
    stream = make_image(image)
    unplug_images = {mode: make_unplug_image(os.path.join(work, f"unplug-{mode}.img")) for mode in MODES}
    # Each mode's second disk on a server of its own behind a delaying proxy of its own.
    unplug_servers = {}
    for mode in MODES:
        unplug_port = guest.free_port()
        unplug_log = open(os.path.join(guest.LOGS, f"wan-storage.unplug-{mode}.log"), "w")
        unplug_servers[mode] = (
            subprocess.Popen([BIN, "serve", "-v", "--listen", f"127.0.0.1:{unplug_port}", "--no-advertise",
                              "--control", os.path.join(work, f"c-{mode}.sock"),
                              "--virtual", f"disk={os.path.join(work, f'unplug-{mode}.img')},size=64M"],
                             stdout=unplug_log, stderr=subprocess.STDOUT),
            cutproxy.CutProxy(("127.0.0.1", unplug_port), delay=DELAY))
    sums = {}
    port = guest.free_port()
    log_path = os.path.join(guest.LOGS, "wan-storage.server.log")
    log = open(log_path, "w")
    server = subprocess.Popen([BIN, "serve", "-v", "--listen", f"127.0.0.1:{port}", "--no-advertise",
                               "--control", os.path.join(work, "c.sock"),
                               "--virtual", f"disk={image},size=64M,bad={BAD_BLOCKS}"],
                              stdout=log, stderr=subprocess.STDOUT)
    proxy = cutproxy.CutProxy(("127.0.0.1", port), delay=DELAY)
    g = None
    try:
        busid = busid_of_the_disk(port, server)
        proxy_port = proxy.start()
        script = SCRIPT.replace("__PORT__", str(proxy_port)).replace("__BUSID__", busid)
        for mode in MODES:
            script = script.replace(f"__UNPLUG_{mode}__", str(unplug_servers[mode][1].start()))

        def withdraw(line):
            """The guest is streaming its second disk: its server goes (SIGTERM: it ends
            its sessions, as a server whose device was unplugged does), the disk with it."""
            if "@@UNPLUG " in line:
                mode = line.split("@@UNPLUG ", 1)[1].split()[0]
                gone = unplug_servers[mode][0]
                gone.terminate()
                try:
                    stopped = gone.wait(20) is not None
                except subprocess.TimeoutExpired:
                    stopped = False
                checks.check(f"{mode}: the second disk's server stopped", stopped)
        g = guest.Guest("wan-storage", script, files={BIN: "/usr/bin/usbwire", **E2FS}, timeout=600)
        times, relay, sums, faults = read_console(g, checks, EXPECTED, withdraw)
        checks.check("guest script exit code", g.finish(60) == 0)
        print_table(times)
        faults_as_local(checks, faults, stream)
        unplugs_as_local(checks, faults, unplug_images)
        relay_pipelined(checks, relay.get("accelerated", ""), "accelerated")
        checks.check("command-size: the accelerated disk takes 1 MiB commands, the others usb-storage's 120 KiB",
                     faults["limits"] == {"accelerated": 1024, "off": 120, "stock": 120}, faults["limits"])
        port_metrics(checks, faults["prometheus"].get("accelerated", ""))
        checks.check("the relay with --accelerate off pipelined nothing",
                     "mass storage accelerated" not in relay.get("off", ""), relay.get("off", "")[-1500:])
        log.flush()
        agreed = [line for line in open(log_path, errors="replace") if "stream transforms" in line]
        for line in agreed:
            print(f"server: {line.strip()}")
        # The imports in order: accelerated, off (stock sends no offer at all).
        checks.check("the server granted storage and a descriptor snapshot to the accelerated import",
                     bool(agreed) and "storage=true" in agreed[0] and "descriptors=true" in agreed[0], agreed)
        checks.check("the import with --accelerate off asked for neither",
                     len(agreed) >= 2 and "storage=false" in agreed[1] and "descriptors=false" in agreed[1], agreed)
        snapshot = re.search(r"enumeration answered from the descriptor snapshot answered=(\d+)",
                             relay.get("accelerated", ""))
        print(f"relay (accelerated): {snapshot.group(0) if snapshot else 'no descriptor snapshot line'}")
        checks.check("the accelerated relay answered the kernel's descriptor requests from the snapshot",
                     bool(snapshot) and int(snapshot.group(1)) >= 5, relay.get("accelerated", "")[-1500:])
        stats = proxy.stats()
        checks.check("every import went through the delaying proxy (3 connections or more)",
                     stats["connections"] >= 3, stats["connections"])
    except Exception as error:  # noqa: BLE001 - reported as a failed check
        checks.check("the test ran to the end", False, error)
    finally:
        if g:
            g.kill()
        proxy.stop()
        for unplug_server, unplug_proxy in unplug_servers.values():
            unplug_proxy.stop()
            guest.stop([unplug_server])
        guest.stop([server])
        log.close()
    image_holds_files(checks, image, sums, "the virtual disk's image")
    print(f"logs: {g.console_path if g else guest.LOGS}, {log_path}")
    checks.exit()


if __name__ == "__main__":
    main()
