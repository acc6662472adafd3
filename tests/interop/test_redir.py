#!/usr/bin/env python3
"""usbwire devices in a QEMU guest through usbredir (issue 12): `usbwire serve`
exports a virtual disk (an ext4 image), keyboard and CDC-ACM serial port; a
`usbwire redir` bridge for the disk and one for the keyboard import them over
USB/IP, and the server's own bridge (`serve --redir unix:PATH=class=02`)
offers the serial port. The server is TLS-only with one client key allowed:
the two bridges use that key, the server's own bridge the server's. A guest
(Debian's kernel under TCG) has an xHCI controller and one `-device
usb-redir` per bridge: the disk's and serial's chardevs dial their bridge's
Unix socket (`--listen unix:PATH`, checked to be 0600), the keyboard's bridge
dials QEMU's listening chardev (`--connect`). The guest's own kernel drives the devices as if they were
plugged in: no usbip in the guest.

Checked: the guest mounts the disk (ext4), writes a file and reads it back
past its page cache, and the file is in the host's image afterwards (through the
bridge's storage accelerator and descriptor snapshot, which each import's end logs); typed
keys arrive as key presses; the serial port moves bytes both ways. Then the
disk's usb-redir device is unplugged from QEMU and plugged in again twice
(QMP device_del / chardev-add / device_add): the bridge releases its
USB/IP import each time (the server logs the client leaving and lists the
disk available), and the guest sees the disk come back with the file on it.

    USBWIRE_BIN=target/release/usbwire python3 tests/interop/test_redir.py
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import guest  # noqa: E402
from test_core_server import GUEST_SERIAL_PING, KEYCODES, decode_keys, serial_ping_pong  # noqa: E402

BIN = guest.BIN
MKE2FS = "/sbin/mke2fs"
WORD = "redir42"
FILE_TEXT = "written by the guest through usb-redir"
REPLUGS = 2

GUEST_SCRIPT = r"""
set -u

# Disk: the host made the filesystem; mount, write, read back past the page cache.
wait_path /sys/block/sda 300; check disk-block-device $?
echo "@@DISK-SECTORS $(cat /sys/block/sda/size)"
mount -t ext4 /dev/sda /mnt; check disk-mount $?
echo "__TEXT__" > /mnt/hello.txt
dd if=/dev/urandom of=/mnt/random.bin bs=64k count=64 2>/dev/null
SUM=$(md5sum /mnt/random.bin | cut -d' ' -f1)
sync; umount /mnt; check disk-umount $?
echo 3 > /proc/sys/vm/drop_caches
mount -t ext4 /dev/sda /mnt; check disk-remount $?
[ "$(cat /mnt/hello.txt)" = "__TEXT__" ]; check disk-read-back $?
[ "$(md5sum /mnt/random.bin | cut -d' ' -f1)" = "$SUM" ]; check disk-4mib-read-back $?
umount /mnt
echo "@@DISK-DONE"

# Keyboard: read raw events while the host types.
i=0; while ! grep -q "usbwire keyboard" /proc/bus/input/devices && [ $i -lt 100 ]; do sleep 0.2; i=$((i+1)); done
grep -q "usbwire keyboard" /proc/bus/input/devices; check keyboard-input-device $?
EV=$(awk '/usbwire keyboard/ {f=1} f && /Handlers=/ {for (i=1;i<=NF;i++) if ($i ~ /^event/) {print $i; exit}}' /proc/bus/input/devices)
(timeout 15 cat /dev/input/$EV > /tmp/events) &
sleep 0.5
echo "@@READY-FOR-TYPE"
wait
echo "@@EVENTS-BEGIN"; od -A n -t x1 -v /tmp/events; echo "@@EVENTS-END"

# Serial: bytes both ways between /dev/ttyACM0 and the host's pty.
wait_path /dev/ttyACM0 300; check serial-tty $?
__SERIAL_PING__

# QEMU unplugs the disk's usb-redir device and plugs it in again.
n=1
while [ $n -le __REPLUGS__ ]; do
  echo "@@UNPLUG $n"
  wait_gone /sys/block/sda; check unplug-$n-gone $?
  echo "@@PLUG $n"
  wait_path /sys/block/sda 300; check replug-$n-back $?
  sleep 1
  mount -t ext4 /dev/sda /mnt; check replug-$n-mount $?
  [ "$(cat /mnt/hello.txt)" = "__TEXT__" ]; check replug-$n-file $?
  umount /mnt
  n=$((n+1))
done
echo "@@DMESG-BEGIN"; dmesg | grep -iE "usb|error|reset" | tail -40; echo "@@DMESG-END"
exit 0
"""


class Monitor:
    """QEMU's QMP on a unix socket: one command per connection, its reply
    (QMP's "return", or its "error" as an exception)."""

    def __init__(self, path):
        self.path = path

    def execute(self, command, **arguments):
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(self.path)
            s.settimeout(10)
            stream = s.makefile("rw")
            json.loads(stream.readline())  # the greeting
            for request in [{"execute": "qmp_capabilities"}, {"execute": command, "arguments": arguments}]:
                stream.write(json.dumps(request) + "\n")
                stream.flush()
                while True:
                    reply = json.loads(stream.readline())
                    if "event" not in reply:
                        break
                if "error" in reply:
                    raise RuntimeError(f"QMP {command}: {reply['error'].get('desc', reply['error'])}")
            return reply.get("return")

    def plug_redir(self, device_id, chardev, where):
        """A usb-redir device `device_id` on xhci.0 whose new chardev dials
        `where`: a Unix socket's path, or a port on 127.0.0.1; "" or what
        QEMU said against it."""
        if isinstance(where, int):
            addr = {"type": "inet", "data": {"host": "127.0.0.1", "port": str(where)}}
        else:
            addr = {"type": "unix", "data": {"path": where}}
        try:
            self.execute("chardev-add", id=chardev, backend={"type": "socket", "data": {"addr": addr, "server": False}})
            deadline = time.time() + 10
            while True:
                try:
                    self.execute("device_add", driver="usb-redir", chardev=chardev, id=device_id, bus="xhci.0")
                    return ""
                except RuntimeError as error:  # an unplugged device's id until its removal completes
                    if "uplicate" not in str(error) or time.time() > deadline:
                        raise
                    time.sleep(0.2)
        except RuntimeError as error:
            return str(error)


class Log:
    """A process's log file, read from a mark on."""

    def __init__(self, path):
        self.path = path

    def text(self):
        with open(self.path, errors="replace") as f:
            return f.read()

    def count(self, needle):
        return self.text().count(needle)

    def wait_count(self, needle, n, timeout):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.count(needle) >= n:
                return True
            time.sleep(0.2)
        return False

    def tail(self, n=10):
        return "\n    ".join(self.text().splitlines()[-n:])


def start_logged(name, cmd):
    path = os.path.join(guest.LOGS, f"redir.{name}.log")
    out = open(path, "w")
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT), Log(path)


def busids(port, tls):
    out = subprocess.run([BIN, "list", "-r", f"127.0.0.1:{port}", "--json"] + tls, capture_output=True, text=True)
    if out.returncode != 0:
        return None
    data = json.loads(out.stdout)
    devices = data["devices"] if isinstance(data, dict) else data
    found = {}
    for d in devices:
        text = json.dumps(d)
        for kind in ("disk", "keyboard", "serial"):
            if f"usbwire {kind}" in text:
                found[kind] = d["busid"]
    return found


def disk_available(port, busid, tls):
    out = subprocess.run([BIN, "list", "-r", f"127.0.0.1:{port}", "--json"] + tls, capture_output=True, text=True)
    if out.returncode != 0:
        return False
    data = json.loads(out.stdout)
    devices = data["devices"] if isinstance(data, dict) else data
    return any(d["busid"] == busid and d.get("state", "available") == "available" for d in devices)


def sample(text, series):
    """The value of the first sample line starting with `series`, or None."""
    line = next((line for line in text.splitlines() if line.startswith(series)), None)
    return float(line.rsplit(" ", 1)[1]) if line else None


def check_metrics(checks, metrics_port, disk):
    """The server's /metrics passes promtool and counted what the guest did with the disk."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    with open(os.path.join(guest.LOGS, "redir.metrics.txt"), "w") as f:
        f.write(text)
    lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    checks.check("promtool check metrics accepts /metrics", lint.returncode == 0, lint.stdout + lint.stderr)
    labels = f'busid="{disk}",kind="disk"'
    imports = sample(text, f"usbwire_device_imports_total{{{labels}}}")
    checks.check(f"metrics: {1 + REPLUGS} imports of the disk (one per plug)", imports == 1 + REPLUGS, imports)
    written = sample(text, f'usbwire_device_bytes_total{{{labels},direction="out",transfer="bulk"}}')
    checks.check("metrics: the guest's 4 MiB and more written to the disk", (written or 0) >= 4 << 20, written)
    checks.check("metrics: nothing left in flight",
                 sample(text, f"usbwire_device_urbs_in_flight{{{labels}}}") == 0, text[-300:])


def main():
    guest.require(BIN, "/usr/bin/qemu-system-x86_64", MKE2FS)
    checks = guest.Checks()
    os.makedirs(guest.LOGS, exist_ok=True)
    work = guest.scratch("usbwire-redir-")
    image = os.path.join(work, "disk.img")
    link = os.path.join(work, "ttyUSBWIRE")
    control = os.path.join(work, "control.sock")
    monitor_path = os.path.join(work, "monitor.sock")
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    subprocess.run([MKE2FS, "-q", "-F", "-t", "ext4", image], check=True)
    port = guest.free_port()
    processes = []
    g = None
    # Bridges that QEMU dials listen on Unix sockets; the keyboard's dials QEMU's TCP port.
    bridge_sockets = {kind: os.path.join(work, f"redir-{kind}.sock") for kind in ("disk", "serial")}
    keyboard_port = guest.free_port()
    metrics_port = guest.free_port()
    server_dir, client_dir = os.path.join(work, "server-id"), os.path.join(work, "client-id")
    client_key = json.loads(subprocess.run([BIN, "identity", "--create", "--json", "--dir", client_dir],
                                           capture_output=True, text=True, check=True).stdout)["fingerprint"]
    tls = ["--tls", "--identity", client_dir, "--trust-new"]
    try:
        # TLS only, one client key allowed. The serial port's bridge is the server's own (--redir,
        # found by its class; it connects as the server); the others are `usbwire redir` processes
        # with the client's key.
        server, server_log = start_logged("server", [
            BIN, "serve", "-v", "--listen", f"127.0.0.1:{port}", "--no-advertise", "--control", control,
            "--tls", "--identity", server_dir, "--allow", client_key, "--allow-plain", "never",
            "--virtual", "keyboard", "--virtual", f"disk={image},size=64M,speed=super", "--virtual", f"serial={link}",
            "--redir", f"unix:{bridge_sockets['serial']}=class=02", "--metrics", f"127.0.0.1:{metrics_port}"])
        processes.append(server)
        ids = None
        for _ in range(100):
            ids = busids(port, tls)
            if ids and len(ids) == 3:
                break
            time.sleep(0.1)
        checks.check("server lists disk, keyboard and serial", ids and len(ids) == 3, repr(ids))
        # The keyboard's bridge dials a listening QEMU (--connect); the others wait for QEMU to dial.
        dials = {"keyboard"}
        bridge_logs = {"serial": server_log}
        for kind in ("disk", "keyboard"):
            side = ["--connect", f"127.0.0.1:{keyboard_port}"] if kind in dials else \
                ["--listen", f"unix:{bridge_sockets[kind]}"]
            proc, log = start_logged(f"bridge-{kind}", [
                BIN, "redir", "-v", "-r", f"127.0.0.1:{port}", "-b", ids[kind]] + tls + side)
            processes.append(proc)
            bridge_logs[kind] = log
        for kind, log in bridge_logs.items():
            if kind not in dials:
                checks.check(f"bridge for the {kind} listens", log.wait_count("waiting for a usb-redir guest", 1, 10),
                             log.tail())
                mode = os.stat(bridge_sockets[kind]).st_mode & 0o777
                checks.check(f"bridge for the {kind}: its socket is 0600", mode == 0o600, oct(mode))

        def redir_args(kind):
            # As README.md shows them: QEMU dials (and redials) a listening bridge, or listens for one.
            if kind in dials:
                where = f"host=127.0.0.1,port={keyboard_port},server=on,wait=off"
            else:
                where = f"path={bridge_sockets[kind]},reconnect=2"
            return ["-chardev", f"socket,id=rd-{kind},{where}",
                    "-device", f"usb-redir,chardev=rd-{kind},id=redir-{kind},bus=xhci.0"]

        qemu_args = ["-device", "qemu-xhci,id=xhci", "-qmp", f"unix:{monitor_path},server=on,wait=off"]
        for kind in ("disk", "keyboard", "serial"):
            qemu_args += redir_args(kind)
        script = GUEST_SCRIPT.replace("__TEXT__", FILE_TEXT).replace("__REPLUGS__", str(REPLUGS))
        script = script.replace("__SERIAL_PING__\n", GUEST_SERIAL_PING)
        g = guest.Guest("redir", script, timeout=900, qemu_args=qemu_args)
        g.wait_for("@@BOOTED", 180)

        def guest_check(name, timeout=180):
            line = g.wait_for(f"@@CHECK {name} ", timeout)
            checks.check(f"guest: {name}", " PASS" in line, line)

        guest_check("disk-block-device")
        sectors = int(g.wait_for("@@DISK-SECTORS").split()[-1])
        checks.check("disk is 64 MiB", sectors * 512 == 64 << 20, f"{sectors} sectors")
        for name in ["disk-mount", "disk-umount", "disk-remount", "disk-read-back", "disk-4mib-read-back"]:
            guest_check(name)
        g.wait_for("@@DISK-DONE")
        out = subprocess.run(["debugfs", "-R", "cat /hello.txt", image], capture_output=True, text=True)
        checks.check("the guest's file is in the host's image", out.stdout.strip() == FILE_TEXT, out.stdout + out.stderr)

        guest_check("keyboard-input-device")
        g.wait_for("@@READY-FOR-TYPE")
        typed = subprocess.run([BIN, "type", "--control", control, WORD], capture_output=True, text=True)
        checks.check("usbwire type accepted the text", typed.returncode == 0, typed.stderr)
        presses = decode_keys(g.collect("@@EVENTS-BEGIN", "@@EVENTS-END", 60).splitlines())
        expected = [KEYCODES[c] for c in WORD]
        checks.check("typed text arrives as key presses", presses == expected, f"expected {expected}, got {presses}")

        guest_check("serial-tty")
        serial_ping_pong(g, checks, link)

        monitor = Monitor(monitor_path)
        disk_log = bridge_logs["disk"]
        for n in range(1, REPLUGS + 1):
            g.wait_for(f"@@UNPLUG {n}", 60)
            monitor.execute("device_del", id="redir-disk")
            guest_check(f"unplug-{n}-gone", 120)
            released = disk_log.wait_count("guest disconnected; device released", n, 30)
            checks.check(f"unplug {n}: the bridge released its import", released, disk_log.tail())
            # The import that ended ran the guest's usb-storage through the accelerators.
            accelerated = disk_log.wait_count("mass storage accelerated", n, 10)
            checks.check(f"unplug {n}: the bridge ran the guest's disk commands through the storage accelerator",
                         accelerated, disk_log.tail())
            deadline = time.time() + 15
            while time.time() < deadline and not disk_available(port, ids["disk"], tls):
                time.sleep(0.2)
            checks.check(f"unplug {n}: the server lists the disk available again", disk_available(port, ids["disk"], tls),
                         server_log.tail())
            g.wait_for(f"@@PLUG {n}", 30)
            # A new chardev each time: the old one may outlive its device a while.
            plugged = monitor.plug_redir("redir-disk", f"rd-disk-{n}", bridge_sockets["disk"])
            checks.check(f"plug {n}: QEMU took the device back", plugged == "", plugged)
            for name in [f"replug-{n}-back", f"replug-{n}-mount", f"replug-{n}-file"]:
                guest_check(name)
        dmesg = g.collect("@@DMESG-BEGIN", "@@DMESG-END", 60)
        checks.check("no I/O error in the guest's kernel log", "I/O error" not in dmesg, dmesg)
        rc = g.finish(60)
        checks.check("guest script exit code", rc == 0, str(rc))
        for kind, log in bridge_logs.items():
            checks.check(f"bridge for the {kind}: no malformed packet or failure",
                         log.count("malformed") == 0 and log.count("ERROR") == 0, log.tail())
        checks.check("server saw each disk import end cleanly", server_log.count("connection lost") == 0,
                     server_log.tail())
        check_metrics(checks, metrics_port, ids["disk"])
        print(f"guest ran {time.time() - g.started:.1f} s", flush=True)
    except Exception as error:  # a wait that timed out is a failure with a reason
        checks.check("test ran to the end", False, str(error))
    finally:
        if g:
            g.kill()
        guest.stop(processes)
        print(f"logs: {guest.LOGS}/redir.*", flush=True)
    checks.exit()


if __name__ == "__main__":
    main()
