#!/usr/bin/env python3
"""Real USB devices shared through usbfs (issue 4), against a real kernel.

A QEMU guest with QEMU-emulated USB devices on xHCI (a flash drive, a keyboard,
an FTDI serial adapter) runs our binary: `usbwire list -l` shows them with
their kernel drivers, `usbwire serve` + `usbwire bind` exports them. From the
host, with our client and with a minimal independent USB/IP client written
here: list, describe, read disk sectors (must match the image), write bytes
through the serial adapter (must reach QEMU's chardev), bad URBs get error
statuses, the kernel driver is detached while imported and comes back on
release and on unbind, and a device unplugged (QEMU `device_del`) while
imported ends its pending URB with -ESHUTDOWN and a clean close, leaving the
server healthy. The xHCI controller is on buses 1 and 2, as on most machines:
the keyboard sits at 1-1, and a server with a virtual mouse (0-1) beside it
exports both, `bind`/`unbind -b 1-1` agreeing with `state`. Last, the vhci guest
follows the port 1-1 (`usbwire attach --follow`) while QEMU replaces the device
there with another VID:PID twenty times (`device_del` / `device_add`): each new
device must reach the vhci guest with its driver bound, none missed, and the
time from `device_add` to that is printed.

Run: python3 tests/interop/test_real_devices.py   (USBWIRE_BIN=path/to/usbwire)
"""

import http.server
import json
import os
import queue
import socket
import struct
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import guest  # noqa: E402

BIN = guest.BIN
READ_SECTORS = guest.READ_SECTORS

# The guest runs whatever the host hands it, one command at a time, and prints
# the result; the host drives the test through `Remote.run`.
COMMAND_LOOP = r"""
while true; do
  cmd=$(wget -q -O - http://10.0.2.2:__CMD__/next 2>/dev/null) || { sleep 0.3; continue; }
  [ -z "$cmd" ] && continue
  [ "$cmd" = exit ] && break
  out=$(sh -c "$cmd" 2>&1); rc=$?
  echo "@@OUT rc=$rc $(echo "$out" | tr '\n' ' ')"
done
"""

SERVER_SCRIPT = r"""
set -u
export C="--control /run/usbwire.sock"
# The initramfs loads vhci-hcd (buses 1-16) before xhci-pci. This guest needs no vhci:
# reloading xhci-pci without it puts the real controller on buses 1 and 2, as on most
# machines, so a real device sits at 1-1 beside the virtual devices on bus 0.
rmmod usbip_host vhci_hcd usbip_core 2>/dev/null
rmmod xhci_pci && insmod /lib/modules/xhci-pci.ko || echo "@@XHCI-RELOAD-FAILED"
mkdir -p /etc/usbwire
printf '[[bind]]\ndevice = "0627:0001"\n' > /etc/usbwire/server.toml
usbwire serve -v --listen 0.0.0.0:3240 --config /etc/usbwire/server.toml $C > /tmp/serve.log 2>&1 &
i=0; while [ ! -S /run/usbwire.sock ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
echo "@@SERVER-UP"
""" + COMMAND_LOOP + r"""
echo "@@SERVE-LOG-BEGIN"; cat /tmp/serve.log; echo "@@SERVE-LOG-END"
exit 0
"""

# The second guest only has vhci-hcd: the kernel's client and ours attach from it.
VHCI_SCRIPT = "set -u\necho @@VHCI-UP\n" + COMMAND_LOOP + "exit 0\n"


ESHUTDOWN = -108
EPIPE = -32
EINVAL = -22



class Remote:
    """Runs shell commands in the guest: it fetches them over HTTP from us."""

    def __init__(self):
        self.g = None
        self.commands = queue.Queue()
        commands = self.commands

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                try:
                    cmd = commands.get(timeout=5)
                except queue.Empty:
                    self.send_response(204)
                    self.end_headers()
                    return
                body = cmd.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.http.server_address[1]
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def run(self, cmd, timeout=60):
        """(exit code, output with newlines as spaces)."""
        self.commands.put(cmd)
        line = self.g.wait_for("@@OUT rc=", timeout)
        rc, _, out = line.split("@@OUT rc=", 1)[1].partition(" ")
        return int(rc), out

    def close(self):
        self.commands.put("exit")


class UsbipClient:
    """A minimal USB/IP client, independent of ours: import, submit, read replies."""

    def __init__(self, addr, busid):
        host, port = addr.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.sock.sendall(struct.pack(">HHI", 0x0111, 0x8003, 0) + busid.encode().ljust(32, b"\0"))
        header = self.recv(8)
        _, code, status = struct.unpack(">HHI", header)
        if status != 0:
            raise RuntimeError(f"import of {busid} refused with status {status}")
        record = self.recv(312)
        self.busnum, self.devnum = struct.unpack(">II", record[288:296])
        self.devid = (self.busnum << 16) | self.devnum
        self.seq = 0
        self.direction_in = {}

    def recv(self, n):
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise EOFError(f"connection closed after {len(data)} of {n} bytes")
            data += chunk
        return data

    def submit(self, ep, direction_in, length=0, data=b"", setup=b"\0" * 8):
        self.seq += 1
        header = struct.pack(">IIIII", 1, self.seq, self.devid, 1 if direction_in else 0, ep)
        header += struct.pack(">IiiiI", 0, len(data) if not direction_in else length, 0, 0, 0) + setup
        self.sock.sendall(header + (b"" if direction_in else data))
        self.direction_in[self.seq] = direction_in
        return self.seq

    def submit_iso_out(self, ep, packets):
        """An isochronous OUT URB, one packet per bytes object; returns the seqnum."""
        self.seq += 1
        data = b"".join(packets)
        header = struct.pack(">IIIII", 1, self.seq, self.devid, 0, ep)
        header += struct.pack(">IiiiI", 0x0002, len(data), 0, len(packets), 1) + b"\0" * 8
        descriptors, offset = b"", 0
        for packet in packets:
            descriptors += struct.pack(">IIIi", offset, len(packet), 0, 0)
            offset += len(packet)
        self.sock.sendall(header + data + descriptors)
        self.direction_in[self.seq] = False
        return self.seq

    def reply_iso(self):
        """(seqnum, status, [(length, actual_length, status)]) of an isochronous OUT RET_SUBMIT."""
        head = self.recv(48)
        seq, = struct.unpack(">I", head[4:8])
        status, actual, _, number_of_packets, error_count = struct.unpack(">iIiii", head[20:40])
        packets = []
        for _ in range(max(number_of_packets, 0)):
            _, length, got, packet_status = struct.unpack(">IIIi", self.recv(16))
            packets.append((length, got, packet_status))
        return seq, status, packets

    def unlink(self, target):
        """Sends CMD_UNLINK for `target`; returns the unlink's own seqnum."""
        self.seq += 1
        self.sock.sendall(struct.pack(">IIIIII", 2, self.seq, self.devid, 0, 0, target) + b"\0" * 24)
        return self.seq

    def reply_any(self):
        """(command, seqnum, status) of the next reply, reading any data it carries."""
        head = self.recv(48)
        command, seq = struct.unpack(">II", head[:8])
        status, actual = struct.unpack(">iI", head[20:28])
        if command == 3 and self.direction_in.get(seq) and actual:
            self.recv(actual)
        return command, seq, status

    def reply(self):
        """(seqnum, status, actual_length, data) of the next RET_SUBMIT."""
        head = self.recv(48)
        # Like the kernel stub, RET_SUBMIT need not repeat devid/direction/ep: use ours.
        command, seq = struct.unpack(">II", head[:8])
        status, actual = struct.unpack(">iI", head[20:28])
        assert command == 3, f"expected RET_SUBMIT, got command {command}"
        data = self.recv(actual) if self.direction_in.get(seq) and actual else b""
        return seq, status, actual, data

    def close(self):
        self.sock.close()


def qemu_monitor(path, command):
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        s.settimeout(5)
        s.recv(4096)  # banner
        s.sendall(command.encode() + b"\n")
        time.sleep(0.5)
        return s.recv(4096).decode(errors="replace")


def by_id(devices, vid, pid):
    return next((d for d in devices if d["vendor_id"] == vid and d["product_id"] == pid), None)


def exported(addr):
    """{busid: device record} of what the server lists, or {} when it does not answer."""
    out = subprocess.run([BIN, "list", "-r", addr, "--json"], capture_output=True, text=True)
    return {d["busid"]: d for d in json.loads(out.stdout)["devices"]} if out.returncode == 0 else {}


def server_state(remote):
    rc, out = remote.run("usbwire state --json $C")
    return {d["busid"]: d for d in json.loads(out)["devices"]} if rc == 0 else {}


def restart_server(remote, config, extra=""):
    """Stops the guest's server and starts it again with CONFIG (one line per TOML line)."""
    toml = "\\n".join(config)
    return remote.run(
        "killall usbwire; i=0; while pidof usbwire >/dev/null && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done; "
        f"rm -f /etc/usbwire/server.binds; printf '{toml}\\n' > /etc/usbwire/server.toml; "
        f"usbwire serve -v --listen 0.0.0.0:3240 --config /etc/usbwire/server.toml {extra} $C >> /tmp/serve.log 2>&1 & "
        "i=0; while [ ! -S /run/usbwire.sock ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done; sleep 1; echo up",
        timeout=90)


def real_beside_virtual(remote, addr, checks):
    """A real device at 1-1 and a virtual one on bus 0, on one server: both exported
    under their own bus ids, and bind/unbind of 1-1 agree with `state`."""
    rc, out = restart_server(remote, ['[[bind]]', 'device = "1-1"'], "--virtual mouse")
    checks.check("the server restarts with a virtual mouse and a [[bind]] rule for 1-1", rc == 0, out)
    listed = {}
    for _ in range(30):
        listed = exported(addr)
        if "1-1" in listed and "0-1" in listed:
            break
        time.sleep(1)
    real, virtual = listed.get("1-1", {}), listed.get("0-1", {})
    checks.check("the real keyboard at 1-1 and the virtual mouse at 0-1 are both exported",
                 real.get("kind") == "host" and (real.get("vendor_id"), real.get("product_id")) == ("0627", "0001")
                 and virtual.get("kind") == "mouse", listed)
    state = server_state(remote)
    checks.check("state names the same two devices", sorted(state) == sorted(listed)
                 and state.get("1-1", {}).get("kind") == "host" and state.get("0-1", {}).get("kind") == "mouse",
                 state)
    rc, out = remote.run("usbwire unbind -b 1-1 $C")
    checks.check("unbind -b 1-1 withdraws the real device", rc == 0 and "complete" in out, out)
    refused = subprocess.run([BIN, "describe", "-r", addr, "-b", "1-1"], capture_output=True, text=True)
    checks.check("an import of 1-1 is then refused with the reason: unbound on the server",
                 refused.returncode != 0 and "no longer exported (unbound on the server) at 20" in refused.stderr,
                 refused.stderr[-400:])
    checks.check("after unbind -b 1-1 the virtual 0-1 stays, in list -r and in state",
                 sorted(exported(addr)) == ["0-1"] and sorted(server_state(remote)) == ["0-1"], out)
    rc, out = remote.run("usbwire bind -b 1-1 $C")
    checks.check("bind -b 1-1 exports the real device again", rc == 0 and "complete" in out, out)
    checks.check("after bind -b 1-1 list -r and state agree on 0-1 and 1-1",
                 sorted(exported(addr)) == ["0-1", "1-1"] and sorted(server_state(remote)) == ["0-1", "1-1"], out)


# Watches the vhci guest's imported device and prints its ids and bound drivers on each change.
WATCH_VHCI = r"""
last=""
while true; do
  cur=none
  for d in /sys/bus/usb/devices/*-*; do
    case "$d" in *:*) continue;; esac
    case "$(readlink -f "$d")" in *vhci_hcd*) ;; *) continue;; esac
    drivers=""
    for i in "$d"/*:*; do [ -e "$i/driver" ] && drivers="$drivers$(basename "$(readlink "$i/driver")"),"; done
    cur="$(cat "$d/idVendor" 2>/dev/null):$(cat "$d/idProduct" 2>/dev/null):$drivers"
  done
  [ "$cur" != "$last" ] && echo "@@SEEN $cur" && last=$cur
  sleep 0.05
done
"""

# The device put at port 1 in turn, with the VID:PID and the driver the vhci guest binds.
REPLACEMENTS = [
    ("usb-serial,bus=xhci.0,port=1,chardev=spareser", "0403:6001", "ftdi_sio"),
    ("usb-kbd,bus=xhci.0,port=1", "0627:0001", "usbhid"),
]
REPLACEMENT_ROUNDS = 20
# The target for a replacement is 2 s from plug to the client's driver bound (FOLLOW_TARGET_S).
# Here both machines are QEMU guests under TCG, and each enumerates the new device: on 2
# cores, 1.70-1.92 s end to end in a CI run (20 of 20 within 2 s), 1.40-2.87 s with other
# builds beside it at a load average of 8-10 (8 of 20), 2026-11-26 at 96571e7 and 95ad1b9.
# The check allows that; the test prints every time and how many met the target.
FOLLOW_TARGET_S = 2.0
FOLLOW_BOUND_S = 5.0


def follow_replacements(remote, vhci, monitor, port, checks):
    """`usbwire attach --follow` of the bus id 1-1 in the vhci guest while QEMU replaces the
    device at that port with another VID:PID, REPLACEMENT_ROUNDS times."""
    rc, out = vhci.run(f"usbwire -v attach --follow -r 10.0.2.2:{port} -b 1-1")
    checks.check("usbwire attach --follow of the real port 1-1", rc == 0, out)
    vhci.commands.put(f"sh -c '{WATCH_VHCI.strip()}' > /dev/console 2>&1 &")
    first = vhci.g.wait_for("@@SEEN 0627:0001:usbhid", 60)
    checks.check("the vhci guest has the keyboard from 1-1 with usbhid bound", "usbhid" in first, first)
    current = "kbd2"
    times, missed = [], []
    for round_ in range(REPLACEMENT_ROUNDS):
        device, ids, driver = REPLACEMENTS[round_ % len(REPLACEMENTS)]
        qemu_monitor(monitor, f"device_del {current}")
        time.sleep(1)  # a hand swapping a device takes longer than that
        current = f"repl{round_}"
        started = time.monotonic()
        reply = qemu_monitor(monitor, f"device_add {device},id={current}")
        try:
            vhci.g.wait_for(f"@@SEEN {ids}:{driver}", 30)
            times.append(time.monotonic() - started)
        except Exception as error:  # noqa: BLE001 - a miss is reported with what both sides saw
            _, server_saw = remote.run("usbwire state --json $C; usbwire list -l; dmesg | tail -n 25; "
                                       "tail -n 40 /tmp/serve.log")
            _, client_saw = vhci.run("usbwire port; tail -n 40 /var/run/vhci_hcd/usbwire-relay.log")
            missed.append((round_, ids, str(error), reply, server_saw, client_saw))
            break
    print(f"replacement at 1-1 -> the vhci guest has it, driver bound: "
          f"{', '.join(f'{t:.2f}' for t in times)} s; "
          f"{sum(t <= FOLLOW_TARGET_S for t in times)} of {len(times)} within {FOLLOW_TARGET_S} s")
    checks.check(f"all {REPLACEMENT_ROUNDS} replacements at 1-1 reach the following client, none missed",
                 not missed, missed)
    slow = [t for t in times if t > FOLLOW_BOUND_S]
    checks.check(f"each replacement is on the client within {FOLLOW_BOUND_S} s (two TCG guests)", not slow and times,
                 f"{len(slow)} slower: {slow}")
    rc, out = vhci.run("usbwire port")
    checks.check("usbwire port counts the re-attaches", rc == 0 and "attached again" in out, out)


def main():
    guest.require(BIN, READ_SECTORS)
    guest.build()
    checks = guest.Checks()
    work = guest.scratch("usbwire-real-")
    image = os.path.join(work, "stick.img")
    files = os.path.join(work, "files")
    os.makedirs(files)
    known = "shared-through-usbfs-" + os.urandom(4).hex()
    with open(os.path.join(files, "hello.txt"), "w") as f:
        f.write(known + "\n")
    guest.run(["mke2fs", "-q", "-t", "ext2", "-d", files, image, "8M"], capture_output=True)
    serial_out = os.path.join(work, "serial.out")
    monitor = os.path.join(work, "monitor.sock")
    port = guest.free_port()
    qemu = ["-device", "qemu-xhci,id=xhci",
            "-drive", f"if=none,id=stickdrive,format=raw,file={image}",
            "-device", "usb-storage,bus=xhci.0,port=2,drive=stickdrive,id=stick",
            "-device", "usb-kbd,bus=xhci.0,port=1,id=kbd",
            # QEMU attaches a usb-serial only once its chardev is open: a null one never is.
            "-chardev", f"file,id=spareser,path={os.path.join(work, 'spare-serial.out')}",
            "-chardev", f"file,id=ser,path={serial_out}",
            "-device", "usb-serial,bus=xhci.0,chardev=ser,id=serial",
            "-audiodev", "none,id=snd0",
            "-device", "usb-audio,bus=xhci.0,audiodev=snd0,id=audio",
            "-monitor", f"unix:{monitor},server=on,wait=off"]
    g = None
    remote = vhci = None
    try:
        # The guest fetches commands from a port we learn only after starting the HTTP server.
        remote, vhci = Remote(), Remote()
        g = guest.Guest("real-devices", SERVER_SCRIPT.replace("__CMD__", str(remote.port)), files={BIN: "/usr/bin/usbwire"},
                        hostfwd={3240: port}, timeout=900, qemu_args=qemu)
        remote.g = g
        vhci.g = guest.Guest("real-devices-vhci", VHCI_SCRIPT.replace("__CMD__", str(vhci.port)),
                             files={BIN: "/usr/bin/usbwire"}, timeout=900)
        g.wait_for("@@SERVER-UP", 150)
        addr = f"127.0.0.1:{port}"

        # The guest may still be enumerating the slower devices: QEMU puts the fourth one
        # behind a hub it adds itself, so it enumerates last (seen late in CI under load).
        wanted = {"stick": ("46f4", "0001"), "kbd": ("0627", "0001"),
                  "serial": ("0403", "6001"), "audio": ("46f4", "0002")}
        for _ in range(60):
            rc, out = remote.run("usbwire list -l --json")
            local = json.loads(out)["devices"] if rc == 0 else []
            found = {name: by_id(local, *ids) for name, ids in wanted.items()}
            bound = all(i.get("driver") for name in ("stick", "kbd", "serial") if found[name]
                        for i in found[name]["interfaces"])
            if all(found.values()) and bound:
                break
            time.sleep(1)
        stick, kbd, serial, audio = found["stick"], found["kbd"], found["serial"], found["audio"]
        checks.check("list -l shows the flash drive, keyboard, serial adapter and audio device",
                     stick and kbd and serial and audio, out)
        if not (stick and kbd and serial and audio):
            return checks
        drivers = {d["busid"]: [i["driver"] for i in d["interfaces"]] for d in local}
        checks.check("list -l names each interface's kernel driver",
                     drivers[stick["busid"]] == ["usb-storage"] and drivers[kbd["busid"]] == ["usbhid"]
                     and drivers[serial["busid"]] == ["ftdi_sio"], drivers)
        checks.check("list -l reports real speeds", stick["speed"] == "super" and kbd["speed"] in ("full", "high"),
                     (stick["speed"], kbd["speed"]))
        rc, out = remote.run("usbwire list -l")
        checks.check("list -l text names the busids", rc == 0 and stick["busid"] in out and "usb-storage" in out, out)

        rc, out = remote.run("usbwire bind -b 9-9 $C")
        checks.check("bind of an absent device is a clear error (exit 65)", rc == 65 and "no USB device at 9-9" in out, out)
        for d in (stick, serial, audio):
            rc, out = remote.run(f"usbwire bind -b {d['busid']} $C")
            checks.check(f"bind {d['busid']}", rc == 0 and "complete" in out, out)
        rc, out = remote.run(f"usbwire bind -b {kbd['busid']} $C")
        checks.check("the keyboard is already exported by the config's [[bind]] VID:PID rule", rc != 0 and "already exported" in out, out)

        # The binds outlive the server: kept beside its config, bound again when it starts.
        rc, out = remote.run("cat /etc/usbwire/server.binds")
        checks.check("the binds are kept in server.binds beside the config",
                     rc == 0 and all(d["busid"] in out.split() for d in (stick, serial, audio)), out)
        rc, out = remote.run(
            "killall usbwire; i=0; while pidof usbwire >/dev/null && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done; "
            "usbwire serve -v --listen 0.0.0.0:3240 --config /etc/usbwire/server.toml $C > /tmp/serve-2.log 2>&1 & "
            "i=0; while [ ! -S /run/usbwire.sock ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done; "
            "sleep 1; grep -c 'binds from the last run' /tmp/serve-2.log", timeout=90)
        checks.check("a restarted server reads the binds back", rc == 0 and out.strip().startswith("1"), out)
        for _ in range(30):
            out = subprocess.run([BIN, "list", "-r", addr, "--json"], capture_output=True, text=True)
            back = json.loads(out.stdout)["devices"] if out.returncode == 0 else []
            if len(back) == 4:
                break
            time.sleep(1)
        checks.check("after the restart the same four devices are exported",
                     sorted(d["busid"] for d in back) == sorted(d["busid"] for d in (stick, kbd, serial, audio)),
                     out.stdout + out.stderr)

        out = subprocess.run([BIN, "list", "-r", addr, "--json"], capture_output=True, text=True)
        exported = json.loads(out.stdout)["devices"] if out.returncode == 0 else []
        checks.check("usbwire list -r shows the four real devices under their own busids",
                     sorted(d["busid"] for d in exported) == sorted(d["busid"] for d in (stick, kbd, serial, audio)),
                     out.stdout + out.stderr)
        listed_stick = by_id(exported, "46f4", "0001") or {}
        checks.check("the flash drive is listed as SuperSpeed with its sysfs path",
                     listed_stick.get("speed") == "super" and listed_stick.get("path", "").startswith("/sys/devices/"),
                     listed_stick)

        out = subprocess.run([BIN, "describe", "-r", addr, "-b", stick["busid"], "--json"], capture_output=True, text=True)
        ok = out.returncode == 0 and "08/06/50" in [i["class"] for i in json.loads(out.stdout)["items"] if i["type"] == "interface"]
        checks.check("describe the real flash drive", ok, out.stderr[-300:])

        for attempt in range(20):
            read = subprocess.run([READ_SECTORS, addr, stick["busid"], "0", "64"], capture_output=True)
            if read.returncode == 0:
                break
            time.sleep(0.5)
        with open(image, "rb") as f:
            expected = f.read(64 * 512)
        checks.check("sectors read through usbfs match the image", read.stdout == expected,
                     read.stderr.decode(errors="replace")[-300:])
        # A second guest with vhci-hcd attaches the real devices: the disk with the
        # kernel's own `usbip attach`, the keyboard with ours; keys pressed on the
        # emulated keyboard of the first guest arrive as input events in the second.
        vhci.g.wait_for("@@VHCI-UP", 150)
        server = f"10.0.2.2:{port}"
        rc, out = vhci.run(f"usbip --tcp-port {port} attach -r 10.0.2.2 -b {stick['busid']}")
        checks.check("kernel usbip attach of the real flash drive", rc == 0, out)
        rc, out = vhci.run("i=0; while [ ! -e /sys/block/sda ] && [ $i -lt 100 ]; do sleep 0.2; i=$((i+1)); done; sleep 1; "
                           "mount -t ext2 -o ro /dev/sda /mnt && cat /mnt/hello.txt; umount /mnt", 90)
        checks.check("the vhci guest mounts the shared drive and reads the known file", known in out, out)
        rc, out = vhci.run(f"usbwire attach -r {server} -b {kbd['busid']}")
        checks.check("usbwire attach of the real keyboard", rc == 0, out)
        rc, out = vhci.run("i=0; while ! grep -q 'QEMU USB Keyboard' /proc/bus/input/devices && [ $i -lt 100 ]; do sleep 0.2; "
                           "i=$((i+1)); done; awk '/QEMU USB Keyboard/ {f=1} f && /Handlers=/ {for (i=1;i<=NF;i++) "
                           "if ($i ~ /^event/) {print $i; exit}}' /proc/bus/input/devices", 60)
        event = out.strip()
        checks.check("the keyboard appears as an input device in the vhci guest", rc == 0 and event.startswith("event"), out)
        vhci.commands.put(f"timeout 10 cat /dev/input/{event} > /tmp/events; od -A n -t x1 -v /tmp/events")
        time.sleep(3)
        for key in "usb":
            qemu_monitor(monitor, f"sendkey {key}")
        line = vhci.g.wait_for("@@OUT rc=", 60)
        data = bytes(int(b, 16) for b in line.split("@@OUT rc=", 1)[1].split()[1:] if len(b) == 2)
        presses = [struct.unpack_from("<qqHHi", data, at)[3] for at in range(0, len(data) - 23, 24)
                   if struct.unpack_from("<qqHHi", data, at)[2:5:2] == (1, 1)]
        # KEY_U, KEY_S, KEY_B
        checks.check("keys pressed on the real keyboard arrive in the vhci guest", presses == [22, 31, 48], presses)
        rc, out = vhci.run("for p in $(usbwire port --json | tr ',{}' '\\n\\n\\n' | sed -n 's/.*\"port\":\\([0-9]*\\).*/\\1/p'); "
                           "do usbwire detach -p $p || exit 1; done; usbwire port")
        checks.check("detach both from the vhci guest", rc == 0, out)
        # The server resets a released device and its kernel drivers bind again.
        time.sleep(2)
        for _ in range(20):
            rc, out = remote.run("usbwire list -l --json")
            kbd_back = by_id(json.loads(out)["devices"], "0627", "0001") if rc == 0 else None
            if kbd_back and [i["driver"] for i in kbd_back["interfaces"]] == ["usbhid"]:
                break
            time.sleep(0.5)
        checks.check("after detach the keyboard is back with usbhid",
                     kbd_back and [i["driver"] for i in kbd_back["interfaces"]] == ["usbhid"], out)
        rc, out = remote.run("usbwire list -l --json")
        back = by_id(json.loads(out)["devices"], "46f4", "0001") if rc == 0 else None
        checks.check("after release the flash drive is back with usb-storage",
                     back and [i["driver"] for i in back["interfaces"]] == ["usb-storage"], out)

        # Serial adapter: bytes written to its bulk OUT endpoint reach QEMU's chardev;
        # a URB for an endpoint it does not have, and a malformed control, get error statuses.
        client = UsbipClient(addr, serial["busid"])
        message = b"through-usbfs-" + os.urandom(4).hex().encode()
        client.submit(2, False, data=message)
        _, status, actual, _ = client.reply()
        checks.check("bulk OUT to the serial adapter completes", status == 0 and actual == len(message), (status, actual))
        client.submit(5, True, length=64)
        _, status, _, _ = client.reply()
        checks.check("a URB for an endpoint the device lacks gets -EPIPE", status == EPIPE, status)
        client.submit(0, True, length=4, setup=bytes([0x80, 6, 0, 1, 0, 0, 18, 0]))
        _, status, _, _ = client.reply()
        checks.check("a control IN shorter than its wLength gets -EINVAL", status == EINVAL, status)
        client.submit(0, True, length=18, setup=bytes([0x80, 6, 0, 1, 0, 0, 18, 0]))
        _, status, actual, data = client.reply()
        checks.check("the connection still works after bad URBs (device descriptor)",
                     status == 0 and actual == 18 and data[8:12] == bytes([0x03, 0x04, 0x01, 0x60]), (status, data.hex()))
        client.close()
        time.sleep(1)
        with open(serial_out, "rb") as f:
            written = f.read()
        checks.check("the bytes came out of the emulated serial adapter", message in written, written[-80:])

        # Audio: isochronous OUT streaming on alt setting 1 of interface 1, four URBs of
        # eight 1 ms packets (48 kHz stereo 16-bit = 192 bytes) in flight.
        client = UsbipClient(addr, audio["busid"])
        client.submit(0, False, setup=bytes([0x01, 0x0b, 1, 0, 1, 0, 0, 0]))
        _, status, _, _ = client.reply()
        checks.check("SET_INTERFACE selects the audio streaming alt setting", status == 0, status)
        sent = [client.submit_iso_out(1, [os.urandom(192) for _ in range(8)]) for _ in range(4)]
        results = [client.reply_iso() for _ in sent]
        checks.check("every isochronous URB completes, in order",
                     [r[0] for r in results] == sent and all(r[1] == 0 for r in results), [(r[0], r[1]) for r in results])
        packets = [p for r in results for p in r[2]]
        checks.check("32 packets come back with their lengths, all sent",
                     len(packets) == 32 and all(p == (192, 192, 0) for p in packets), packets[:4])
        client.close()

        # Keyboard: CMD_UNLINK of a pending interrupt IN cancels it on the device: only
        # RET_UNLINK(-ECONNRESET) comes back, as from the kernel's stub.
        client = UsbipClient(addr, kbd["busid"])
        doomed = client.submit(1, True, length=8)
        time.sleep(0.5)
        unlink = client.unlink(doomed)
        answer = client.reply_any()
        checks.check("unlink of a pending URB on the real device answers RET_UNLINK(-ECONNRESET)",
                     answer == (4, unlink, -104), answer)
        # Then keep one pending; the kernel driver is detached meanwhile.
        pending = client.submit(1, True, length=8)
        time.sleep(1)
        rc, out = remote.run("usbwire list -l --json")
        held = by_id(json.loads(out)["devices"], "0627", "0001") if rc == 0 else None
        checks.check("while imported the keyboard's interface is held by usbfs",
                     held and [i["driver"] for i in held["interfaces"]] == ["usbfs"], out)
        rc, out = remote.run("usbwire state --json $C")
        state = {d["busid"]: d for d in json.loads(out)["devices"]} if rc == 0 else {}
        checks.check("state shows the keyboard in use", state.get(kbd["busid"], {}).get("state") == "in_use", out)

        # Unplug it while imported: the pending URB ends with -ESHUTDOWN, then the server closes.
        reply = qemu_monitor(monitor, "device_del kbd")
        started = time.time()
        try:
            seq, status, _, _ = client.reply()
            checks.check("unplug ends the pending URB with -ESHUTDOWN", (seq, status) == (pending, ESHUTDOWN), (seq, status, reply))
            client.sock.settimeout(10)
            try:
                closed = client.sock.recv(1) == b""
            except OSError:
                closed = True
            checks.check("then the server closes the connection cleanly", closed, f"{time.time() - started:.1f}s")
        except Exception as error:
            checks.check("unplug ends the pending URB with -ESHUTDOWN", False, f"{error} ({reply})")
        client.close()
        time.sleep(1)
        out = subprocess.run([BIN, "list", "-r", addr, "--json"], capture_output=True, text=True)
        after = sorted(d["busid"] for d in json.loads(out.stdout)["devices"]) if out.returncode == 0 else None
        checks.check("the server stays healthy and no longer lists the unplugged keyboard",
                     after == sorted(d["busid"] for d in (stick, serial, audio)), out.stdout + out.stderr)
        out = subprocess.run([BIN, "describe", "-r", addr, "-b", kbd["busid"]], capture_output=True, text=True)
        checks.check("an import of the unplugged keyboard is refused with the reason: unplugged, and when",
                     out.returncode != 0 and "unplugged from the server at 20" in out.stderr, out.stderr[-400:])

        # Hotplug: a keyboard plugged in later matches the serve --bind 0627:0001 rule.
        reply = qemu_monitor(monitor, "device_add usb-kbd,bus=xhci.0,port=1,id=kbd2")
        replugged = None
        for _ in range(40):
            out = subprocess.run([BIN, "list", "-r", addr, "--json"], capture_output=True, text=True)
            replugged = by_id(json.loads(out.stdout)["devices"], "0627", "0001") if out.returncode == 0 else None
            if replugged:
                break
            time.sleep(0.5)
        checks.check("a keyboard plugged in later is exported by the rule, no restart", replugged is not None, reply)
        replugged_busid = replugged["busid"] if replugged else None

        # Unbind while imported: the importer is cut off and the drive returns to usb-storage.
        client = UsbipClient(addr, stick["busid"])
        client.submit(0, True, length=18, setup=bytes([0x80, 6, 0, 1, 0, 0, 18, 0]))
        client.reply()
        rc, out = remote.run(f"usbwire unbind -b {stick['busid']} $C")
        checks.check("unbind", rc == 0 and "complete" in out, out)
        client.sock.settimeout(10)
        try:
            closed = client.sock.recv(1) == b""
        except OSError:
            closed = True
        checks.check("unbind closes the importer's connection", closed)
        client.close()
        rc, out = remote.run("i=0; while [ ! -e /sys/block/sda ] && [ $i -lt 50 ]; do sleep 0.2; i=$((i+1)); done; "
                             "usbwire list -l --json; ls /sys/block")
        checks.check("after unbind the drive works locally again (usb-storage, /sys/block/sda)",
                     rc == 0 and '"driver":"usb-storage"' in out and "sda" in out, out)
        rc, out = remote.run(f"usbwire unbind -b {stick['busid']} $C")
        checks.check("unbinding what is not exported is a clear error (exit 65)", rc == 65 and "not exported" in out, out)

        # SIGHUP reloads the [[bind]] rules: the keyboard rule is replaced by one for the drive.
        rc, out = remote.run("printf '[[bind]]\\ndevice = \"46f4:0001\"\\n' > /etc/usbwire/server.toml && "
                             "kill -HUP $(pidof usbwire) && sleep 2 && usbwire state --json $C")
        state = {d["busid"] for d in json.loads(out)["devices"]} if rc == 0 else set()
        checks.check("SIGHUP exports what a new rule matches and withdraws what no rule wants",
                     stick["busid"] in state and replugged_busid not in state, out)
        real_beside_virtual(remote, addr, checks)
        follow_replacements(remote, vhci, monitor, port, checks)
        vhci.close()
        checks.check("vhci guest exit code", vhci.g.finish(60) == 0)
        remote.close()
        joined = g.collect("@@SERVE-LOG-BEGIN", "@@SERVE-LOG-END", 60)
        print(f"arrivals exported only once the kernel had configured them: "
              f"{joined.count('the kernel configured it after announcing it')} of {joined.count('plugged in and exported')}")
        checks.check("the server log has no panic", "panicked" not in joined, joined[-2000:])
        checks.check("guest script exit code", g.finish(60) == 0)
    except Exception as error:
        checks.check("real-device test ran to the end", False, error)
    finally:
        for r in (remote, vhci):
            if r:
                if r.g:
                    r.g.kill()
                r.http.shutdown()
    return checks


if __name__ == "__main__":
    result = main()
    result.exit()
