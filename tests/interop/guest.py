#!/usr/bin/env python3
"""Real Linux kernels for interop tests: Debian's kernel under QEMU (TCG), a
busybox initramfs with the usbip tools, and a live console the test reacts to.

    python3 tests/interop/guest.py build     # prepare the cache (idempotent)

Everything is built from Debian packages into tests/interop/.cache, which CI
starts without: `build()` runs automatically from the tests.
"""

import atexit
import glob
import hashlib
import lzma
import os
import queue
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE = os.path.join(HERE, ".cache")
LOGS = os.path.join(CACHE, "logs")

# Modules, by name; dependencies are added in order by modprobe --show-depends.
MODULES = [
    "virtio_pci", "virtio_net",
    "usbip-core", "vhci-hcd", "usbip-host",
    "usb-storage", "sd_mod",
    "crc32c_generic", "ext4",
    "usbhid", "hid-generic", "evdev",
    "cdc-acm",
    "xhci-pci", "usb-storage", "usbserial", "ftdi_sio",
]
# In the initramfs but loaded only by the scripts that want them (`/modules.extra`, in order):
# USB audio, which would otherwise claim every guest's audio device.
EXTRA_MODULES = ["snd-usb-audio"]
# Debian's programs in the initramfs, with the libraries `ldd` names. dfu-util's libusb
# learns of devices that appear after it started only from udevd's events, so udevd
# (`udevadm` run as `systemd-udevd`, unpacked from Debian's `udev` package like the kernel)
# comes too; a script that needs it starts `/lib/systemd/systemd-udevd --daemon`.
TOOLS = ["/usr/sbin/usbip", "/usr/sbin/usbipd", "/usr/bin/dfu-util"]


def log(msg):
    print(f"[guest] {msg}", flush=True)


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, **kw)


def kernel_package():
    out = subprocess.run(["apt-cache", "depends", "linux-image-amd64"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("Depends: linux-image-"):
            return line.split()[1]
    raise RuntimeError("cannot find the kernel package linux-image-amd64 depends on")


def fetch_kernel():
    """Unpacks Debian's kernel; returns (root dir, version)."""
    root = os.path.join(CACHE, "kernel")
    done = os.path.join(root, ".done")
    if not os.path.exists(done):
        pkg = kernel_package()
        dl = os.path.join(CACHE, "dl")
        os.makedirs(dl, exist_ok=True)
        debs = glob.glob(os.path.join(dl, pkg + "_*.deb"))
        if not debs:
            log(f"downloading {pkg}")
            r = subprocess.run(["apt-get", "download", pkg], cwd=dl, capture_output=True, text=True)
            if r.returncode != 0:
                run(["apt-get", "update", "-qq"])
                run(["apt-get", "download", pkg], cwd=dl)
            debs = glob.glob(os.path.join(dl, pkg + "_*.deb"))
        shutil.rmtree(root, ignore_errors=True)
        run(["dpkg-deb", "-x", debs[0], root])
        open(done, "w").close()
    version = os.listdir(os.path.join(root, "lib/modules"))[0]
    return root, version


def fetch_udev():
    """Unpacks Debian's udev package (not installed on the host); returns udevadm's path."""
    root = os.path.join(CACHE, "udev")
    udevadm = os.path.join(root, "bin", "udevadm")
    if not os.path.exists(udevadm):
        dl = os.path.join(CACHE, "dl")
        os.makedirs(dl, exist_ok=True)
        debs = glob.glob(os.path.join(dl, "udev_*.deb"))
        if not debs:
            log("downloading udev")
            r = subprocess.run(["apt-get", "download", "udev"], cwd=dl, capture_output=True, text=True)
            if r.returncode != 0:
                run(["apt-get", "update", "-qq"])
                run(["apt-get", "download", "udev"], cwd=dl)
            debs = glob.glob(os.path.join(dl, "udev_*.deb"))
        shutil.rmtree(root, ignore_errors=True)
        run(["dpkg-deb", "-x", debs[0], root])
    return udevadm


def extract_vmlinux(bzimage, out):
    """The uncompressed kernel inside a bzImage (boots via PVH, twice as fast under TCG)."""
    if os.path.exists(out):
        return out
    data = open(bzimage, "rb").read()
    at = data.find(b"\xfd7zXZ\x00")
    if at < 0:
        return None
    decompressor = lzma.LZMADecompressor()
    vmlinux = decompressor.decompress(data[at:])
    if not vmlinux.startswith(b"\x7fELF"):
        return None
    with open(out + ".tmp", "wb") as f:
        f.write(vmlinux)
    os.replace(out + ".tmp", out)
    return out


def module_order(root, version, names, skip=()):
    run(["depmod", "-b", root, version])
    order = []
    for name in names:
        out = subprocess.run(["modprobe", "-d", root, "-S", version, "--show-depends", name],
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"module {name}: {out.stderr.strip()}")
        for line in out.stdout.splitlines():
            parts = line.split()
            if parts and parts[0] == "insmod" and parts[1] not in order and parts[1] not in skip:
                order.append(parts[1])
    return order


class Cpio:
    """A newc cpio archive writer (what the kernel unpacks as initramfs)."""

    def __init__(self):
        self.out = bytearray()
        self.ino = 1
        self.dirs = set()

    def _entry(self, name, mode, data=b"", nlink=1):
        name_b = name.encode() + b"\0"
        header = "070701" + "".join(f"{v:08x}" for v in [
            self.ino, mode, 0, 0, nlink, 0, len(data), 0, 0, 0, 0, len(name_b), 0])
        self.ino += 1
        self.out += header.encode() + name_b
        self.out += b"\0" * ((4 - len(self.out) % 4) % 4)
        self.out += data
        self.out += b"\0" * ((4 - len(self.out) % 4) % 4)

    def dir(self, path):
        path = path.strip("/")
        parts = path.split("/")
        for i in range(1, len(parts) + 1):
            d = "/".join(parts[:i])
            if d and d not in self.dirs:
                self.dirs.add(d)
                self._entry(d, stat.S_IFDIR | 0o755, nlink=2)

    def file(self, path, data, mode=0o644):
        path = path.strip("/")
        if "/" in path:
            self.dir(path.rsplit("/", 1)[0])
        self._entry(path, stat.S_IFREG | mode, data)

    def symlink(self, path, target):
        path = path.strip("/")
        if "/" in path:
            self.dir(path.rsplit("/", 1)[0])
        self._entry(path, stat.S_IFLNK | 0o777, target.encode())

    def host_file(self, host_path, guest_path=None, mode=None):
        real = os.path.realpath(host_path)
        st = os.stat(real)
        self.file(guest_path or host_path, open(real, "rb").read(), mode if mode is not None else st.st_mode & 0o777)

    def binary_with_libs(self, host_path, guest_path=None):
        self.host_file(host_path, guest_path, 0o755)
        out = subprocess.run(["ldd", host_path], capture_output=True, text=True).stdout
        for line in out.splitlines():
            parts = line.split()
            lib = parts[2] if "=>" in parts and len(parts) > 2 else parts[0]
            if lib.startswith("/") and lib not in self.dirs:
                self.host_file(lib, lib, 0o755)

    def finish(self):
        self._entry("TRAILER!!!", 0)
        return bytes(self.out)


INIT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
mkdir -p /proc /sys /dev /tmp /mnt /run /var/run
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in $(cat /modules.order); do insmod "$m" 2>/dev/null || echo "insmod $m failed"; done
ip link set lo up
ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0
stty -F /dev/ttyS1 raw -echo 2>/dev/null
echo "@@BOOTED"
sh /run-test.sh
rc=$?
echo "RESULT $rc" > /dev/ttyS1
sync
poweroff -f
"""


def build():
    """Builds (or reuses) vmlinux and the base initramfs; returns their paths."""
    os.makedirs(LOGS, exist_ok=True)
    root, version = fetch_kernel()
    bzimage = os.path.join(root, "boot", f"vmlinuz-{version}")
    kernel = extract_vmlinux(bzimage, os.path.join(CACHE, "vmlinux")) or bzimage
    # The cache key covers everything that goes into the initramfs.
    sources = "".join(open(os.path.join(HERE, c)).read() for c in ("usbloop.c", "pcmplay.c"))
    key = hashlib.sha256((repr(MODULES) + repr(EXTRA_MODULES) + repr(TOOLS) + INIT + sources + version).encode()).hexdigest()[:12]
    initrd = os.path.join(CACHE, f"base-{key}.cpio")
    if os.path.exists(initrd):
        return kernel, initrd
    log("building initramfs")
    order = module_order(root, version, MODULES)
    extra_order = module_order(root, version, EXTRA_MODULES, skip=order)
    cpio = Cpio()
    for d in ["bin", "sbin", "usr/bin", "usr/sbin", "proc", "sys", "dev", "tmp", "mnt", "etc", "lib/modules"]:
        cpio.dir(d)
    cpio.host_file("/bin/busybox", "bin/busybox", 0o755)
    for tool in TOOLS:
        if not os.path.exists(tool):
            sys.exit(f"missing {tool}: install the Debian packages scripts/test.sh lists (usbip, dfu-util)")
        cpio.binary_with_libs(tool)
    cpio.binary_with_libs(fetch_udev(), "usr/bin/udevadm")
    cpio.symlink("lib/systemd/systemd-udevd", "/usr/bin/udevadm")
    for ids in ["/usr/share/hwdata/usb.ids", "/usr/share/misc/usb.ids"]:
        if os.path.exists(ids):
            cpio.host_file(ids, "usr/share/hwdata/usb.ids")
            break
    for listing, modules in (("modules.order", order), ("modules.extra", extra_order)):
        guest_paths = []
        for ko in modules:
            guest = "/lib/modules/" + os.path.basename(ko)
            cpio.host_file(ko, guest, 0o644)
            guest_paths.append(guest)
        cpio.file(listing, ("\n".join(guest_paths) + "\n").encode())
    for tool in ("usbloop", "pcmplay"):
        binary = os.path.join(CACHE, tool)
        run(["gcc", "-static", "-O2", "-o", binary, os.path.join(HERE, f"{tool}.c"), "-lm"])
        cpio.host_file(binary, f"usr/bin/{tool}", 0o755)
    cpio.file("init", INIT.encode(), 0o755)
    cpio.file("etc/passwd", b"root:x:0:0:root:/:/bin/sh\n")
    with open(initrd + ".tmp", "wb") as f:
        f.write(cpio.finish())
    os.replace(initrd + ".tmp", initrd)
    return kernel, initrd


# Shell functions every guest script starts with (`Guest` puts them before its lines).
SCRIPT_HELPERS = r"""
# check NAME STATUS [DETAIL]: one @@CHECK line for the host, PASS when STATUS is 0.
FAILS=0
check() { if [ "$2" = 0 ]; then echo "@@CHECK $1 PASS"; else echo "@@CHECK $1 FAIL ${3:-}"; FAILS=$((FAILS+1)); fi; }
# wait_path PATH [TRIES]: until PATH exists, looking every 0.2 s, TRIES times (100: 20 s).
wait_path() { i=0; while [ $i -lt "${2:-100}" ]; do [ -e "$1" ] && return 0; sleep 0.2; i=$((i+1)); done; return 1; }
# wait_gone PATH [TRIES]: until PATH is gone, the same way (300: 60 s).
wait_gone() { i=0; while [ $i -lt "${2:-300}" ]; do [ -e "$1" ] || return 0; sleep 0.2; i=$((i+1)); done; return 1; }
# wait_for COMMAND TRIES: until COMMAND (eval'd) succeeds, trying every 0.1 s.
wait_for() { i=0; while [ $i -lt $2 ]; do eval "$1" && return 0; sleep 0.1; i=$((i+1)); done; return 1; }
"""


class Guest:
    """A running guest. `wait_for(marker)` returns the console line that has it."""

    def __init__(self, name, script, files=None, hostfwd=None, timeout=300, qemu_args=()):
        kernel, initrd = build()
        os.makedirs(LOGS, exist_ok=True)
        self.name = name
        self.console_path = os.path.join(LOGS, f"{name}.console.log")
        self.result_path = os.path.join(LOGS, f"{name}.result")
        extra = Cpio()
        extra.file("run-test.sh", (SCRIPT_HELPERS + script).encode(), 0o755)
        for host_path, guest_path in (files or {}).items():
            extra.binary_with_libs(host_path, guest_path) if os.access(host_path, os.X_OK) else extra.host_file(host_path, guest_path)
        combined = os.path.join(CACHE, f"{name}.cpio")
        with open(combined, "wb") as f:
            f.write(open(initrd, "rb").read())
            f.write(extra.finish())
        if os.path.exists(self.result_path):
            os.remove(self.result_path)
        netdev = "user,id=n0"
        for guest_port, host_port in (hostfwd or {}).items():
            netdev += f",hostfwd=tcp:127.0.0.1:{host_port}-:{guest_port}"
        cmd = ["timeout", str(timeout), "qemu-system-x86_64",
               "-accel", "tcg,thread=multi", "-cpu", "max", "-m", "768M", "-smp", "1",
               "-no-reboot", "-nodefaults", "-display", "none",
               "-kernel", kernel, "-initrd", combined,
               "-append", "console=ttyS0,115200 panic=-1 loglevel=4 rdinit=/init",
               "-serial", "stdio", "-serial", f"file:{self.result_path}",
               "-netdev", netdev, "-device", "virtio-net-pci,netdev=n0", *qemu_args]
        self.lines = queue.Queue()
        self.log = open(self.console_path, "w")
        # Its own process group, so kill() reaches QEMU and not just `timeout`.
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.started = time.time()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\r\n")
            self.log.write(line + "\n")
            self.log.flush()
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, marker, timeout=120):
        """The first console line containing `marker`, or an exception naming what was seen."""
        deadline = time.time() + timeout
        while True:
            left = deadline - time.time()
            if left <= 0:
                raise TimeoutError(f"guest {self.name}: no {marker!r} within {timeout} s (console: {self.console_path})")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"guest {self.name} stopped before {marker!r} (console: {self.console_path})")
            if marker in line:
                return line

    def collect(self, begin, end, timeout=120):
        """The console lines between the `begin` and `end` markers, joined by newlines."""
        self.wait_for(begin, timeout)
        lines = []
        while True:
            line = self.wait_for("", timeout)
            if end in line:
                return "\n".join(lines)
            lines.append(line)

    def finish(self, timeout=120):
        """Waits for the guest to power off; returns the script's exit code."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"guest {self.name} did not power off (console: {self.console_path})")
        time.sleep(0.2)
        text = open(self.result_path, errors="replace").read() if os.path.exists(self.result_path) else ""
        for line in text.splitlines():
            if line.startswith("RESULT "):
                return int(line.split()[1])
        raise RuntimeError(f"guest {self.name} wrote no result (console: {self.console_path})")

    def kill(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()


ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
# The binary under test and the client example that reads disk sectors.
BIN = os.environ.get("USBWIRE_BIN", os.path.join(ROOT, "target", "release", "usbwire"))
READ_SECTORS = os.path.join(os.path.dirname(BIN), "examples", "read_sectors")


class Checks:
    """Named pass/fail checks, printed as they happen; `failed` lists the failures."""

    def __init__(self):
        self.failed = []

    def check(self, name, ok, detail=""):
        print(f"{'PASS' if ok else 'FAIL'} {name}{(': ' + str(detail)) if detail and not ok else ''}", flush=True)
        if not ok:
            self.failed.append(name)

    def back_within(self, g, marker, name, limit, timeout=120):
        """After something came back on the host (now): the guest's check MARKER passes, within LIMIT s.
        Prints and returns how long it took."""
        started = time.time()
        line = g.wait_for(f"@@CHECK {marker} ", timeout)
        took = time.time() - started
        self.check(name, " PASS" in line, line)
        print(f"{name}: {took:.1f} s (guest under TCG)")
        self.check(f"{name}, within {limit} s (TCG guest)", took < limit, f"{took:.1f} s")
        return took

    def exit(self):
        """Ends the test run: exit status 1 naming the failures, or 0."""
        if self.failed:
            print(f"\n{len(self.failed)} check(s) failed: {', '.join(self.failed)}; logs in {LOGS}")
            sys.exit(1)
        print("all checks passed")


def require(*paths):
    """Exits with what to build when a binary under test is missing."""
    for path in paths:
        if not os.path.exists(path):
            sys.exit(f"missing {path}: run `cargo build --release -p usbwire-cli -p usbwire-client --examples` "
                     "or set USBWIRE_BIN")


def scratch(prefix):
    """A private work directory for one test, removed when the test process exits
    (kept, and named on stderr, when USBWIRE_KEEP_WORK is set)."""
    work = tempfile.mkdtemp(prefix=prefix)
    if os.environ.get("USBWIRE_KEEP_WORK"):
        atexit.register(lambda: print(f"work directory kept: {work}", file=sys.stderr))
    else:
        atexit.register(shutil.rmtree, work, ignore_errors=True)
    return work


def stop(processes):
    """Ends the host processes a test started, last started first: SIGTERM, then SIGKILL
    after 10 s."""
    for proc in reversed(processes):
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def redir_bridge(port, busid, socket_path, log, wait=20, tag=""):
    """A `usbwire redir` bridge importing `busid` from the server on 127.0.0.1:`port` and
    listening on the Unix socket `socket_path` for QEMU (its output to the file `log`), and the
    QEMU arguments of a usb-redir device on the xHCI controller `xhci` dialling it (ids
    `rd`+`tag`, `redir`+`tag`). The socket exists on return unless the bridge failed to listen
    within `wait` seconds."""
    proc = subprocess.Popen(
        [BIN, "redir", "-v", "-r", f"127.0.0.1:{port}", "-b", busid, "--listen", f"unix:{socket_path}"],
        stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + wait
    while not os.path.exists(socket_path) and time.time() < deadline:
        time.sleep(0.1)
    qemu_args = ["-chardev", f"socket,id=rd{tag},path={socket_path},reconnect=2",
                 "-device", f"usb-redir,chardev=rd{tag},id=redir{tag},bus=xhci.0"]
    return proc, qemu_args


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    if sys.argv[1:] == ["build"]:
        print(build())
    else:
        print(__doc__)
