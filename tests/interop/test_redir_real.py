#!/usr/bin/env python3
"""A real USB flash drive through the usbredir bridge, against usbredir's own
exporter (issue 12).

An exporter guest has a QEMU-emulated flash drive (usb-storage on xHCI, an
ext2 image with a known file) and runs `usbwire serve`, which exports it
through usbfs; the host runs `usbwire redir` against that server, and a
second guest plugs a `usb-redir` device into the bridge's Unix socket (QMP
chardev-add + device_add). The second guest's kernel finds the drive, mounts it, reads the
known file, and reads the raw disk (dd) three times with the page cache
dropped. Then the drive is unplugged, the bridge must release its import,
and the same drive is exported by `usbredirect` (Debian's usbredir exporter)
in the exporter guest instead; the second guest plugs straight into it and
does the same reads. Both read speeds are printed (BENCHMARKS.md records
them; the bridge path crosses USB/IP as well). Last, QEMU's USB speaker
(isochronous OUT) in the exporter reaches the second guest through its own
bridge: snd-usb-audio binds it, 3 s of sound are played (raw ALSA ioctls),
and the bridge counts the isochronous packets the speaker took.

    USBWIRE_BIN=target/release/usbwire python3 tests/interop/test_redir_real.py
"""

import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import guest  # noqa: E402
from test_real_devices import COMMAND_LOOP, Remote  # noqa: E402
from test_redir import Monitor, start_logged  # noqa: E402

BIN = guest.BIN
USBREDIRECT = "/usr/bin/usbredirect"
STICK = ("46f4", "0001")
AUDIO = ("46f4", "0002")
AUDIO_SECONDS = 3
READ_MIB = 32
READS = 3
# usbredirect's port in the exporter guest.
REDIRECT_PORT = 4000
# How long the exporter guest may take to enumerate and export both devices.
EXPORT_WAIT_S = 180

EXPORTER_SCRIPT = r"""
set -u
export C="--control /run/usbwire.sock"
mkdir -p /etc/usbwire
printf '[[bind]]\ndevice = "46f4:0001"\n[[bind]]\ndevice = "46f4:0002"\n' > /etc/usbwire/server.toml
usbwire serve -v --listen 0.0.0.0:3240 --config /etc/usbwire/server.toml $C > /tmp/serve.log 2>&1 &
i=0; while [ ! -S /run/usbwire.sock ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
echo "@@SERVER-UP"
""" + COMMAND_LOOP + r"""
echo "@@SERVE-LOG-BEGIN"; cat /tmp/serve.log; echo "@@SERVE-LOG-END"
exit 0
"""

GUEST_SCRIPT = r"""
set -u
for path in bridge usbredirect; do
  echo "@@PLUG $path"
  wait_path /sys/block/sda 600; check $path-block-device $?
  sleep 1
  mount -t ext2 -o ro /dev/sda /mnt; check $path-mount $?
  [ "$(cat /mnt/hello.txt)" = "__TEXT__" ]; check $path-file $?
  umount /mnt
  for i in $(seq __READS__); do
    echo 3 > /proc/sys/vm/drop_caches
    t0=$(cut -d' ' -f1 /proc/uptime)
    dd if=/dev/sda of=/dev/null bs=1M count=__MIB__ 2>/dev/null; rc=$?
    t1=$(cut -d' ' -f1 /proc/uptime)
    check $path-read-$i $rc
    echo "@@READ $path $t0 $t1"
  done
  echo "@@UNPLUG $path"
  wait_gone /sys/block/sda; check $path-gone $?
done
# Audio: QEMU's USB speaker (isochronous OUT), played with raw ALSA ioctls.
for m in $(cat /modules.extra); do insmod $m 2>/dev/null; done
echo "@@PLUG audio"
wait_path /dev/snd/pcmC0D0p 600; check audio-pcm $?
out=$(pcmplay /dev/snd/pcmC0D0p __AUDIO_SECONDS__ 2>&1); rc=$?
echo "@@PCMPLAY $out"
check audio-play $rc
echo "@@UNPLUG audio"
wait_gone /dev/snd/pcmC0D0p; check audio-gone $?
echo "@@DMESG-BEGIN"; dmesg | grep -iE "usb|error|reset" | tail -30; echo "@@DMESG-END"
exit 0
"""


def listed(port, ids=STICK):
    out = subprocess.run([BIN, "list", "-r", f"127.0.0.1:{port}", "--json"], capture_output=True, text=True)
    if out.returncode != 0:
        return None
    devices = json.loads(out.stdout)["devices"]
    return next((d for d in devices if (d["vendor_id"], d["product_id"]) == ids), None)


def main():
    guest.require(BIN, USBREDIRECT)
    guest.build()
    checks = guest.Checks()
    work = guest.scratch("usbwire-redir-real-")
    image = os.path.join(work, "stick.img")
    files = os.path.join(work, "files")
    os.makedirs(files)
    known = "a real flash drive through usb-redir " + os.urandom(4).hex()
    with open(os.path.join(files, "hello.txt"), "w") as f:
        f.write(known + "\n")
    guest.run(["mke2fs", "-q", "-t", "ext2", "-d", files, image, "64M"], capture_output=True)
    port, redirect_port = guest.free_port(), guest.free_port()
    bridge_socket = os.path.join(work, "redir-stick.sock")
    monitor_path = os.path.join(work, "qmp.sock")
    exporter = consumer = bridge = audio_bridge = None
    remote = Remote()
    speeds = {}
    try:
        exporter = guest.Guest(
            "redir-exporter", EXPORTER_SCRIPT.replace("__CMD__", str(remote.port)),
            files={BIN: "/usr/bin/usbwire", USBREDIRECT: "/usr/bin/usbredirect"},
            hostfwd={3240: port, REDIRECT_PORT: redirect_port}, timeout=900,
            qemu_args=["-device", "qemu-xhci,id=xhci", "-drive", f"if=none,id=stickdrive,format=raw,file={image}",
                       "-device", "usb-storage,bus=xhci.0,drive=stickdrive,id=stick",
                       "-audiodev", "none,id=snd0", "-device", "usb-audio,bus=xhci.0,audiodev=snd0,id=audio"])
        remote.g = exporter
        exporter.wait_for("@@SERVER-UP", 180)
        # Under TCG on a loaded machine the exporter's kernel may take long to
        # enumerate a device (descriptor reads time out and are retried).
        stick = audio = None
        deadline = time.monotonic() + EXPORT_WAIT_S
        while time.monotonic() < deadline:
            stick, audio = listed(port), listed(port, AUDIO)
            if stick and audio:
                break
            time.sleep(1)
        if not (stick and audio):
            _, seen = remote.run("ls /sys/bus/usb/devices; dmesg | tail -n 30; tail -n 30 /tmp/serve.log")
            raise RuntimeError(f"after {EXPORT_WAIT_S} s the exporter guest's usbwire serve listed flash drive "
                               f"{stick}, audio {audio}; the guest's USB devices, kernel log and serve log: {seen}")
        busid = stick["busid"]
        bridge, bridge_log = start_logged("real-bridge", [
            BIN, "redir", "-v", "-r", f"127.0.0.1:{port}", "-b", busid, "--listen", f"unix:{bridge_socket}"])
        checks.check("the bridge listens", bridge_log.wait_count("waiting for a usb-redir guest", 1, 10),
                     bridge_log.tail())

        audio_socket = os.path.join(work, "redir-audio.sock")
        audio_bridge, audio_log = start_logged("real-audio-bridge", [
            BIN, "redir", "-v", "-r", f"127.0.0.1:{port}", "-b", audio["busid"], "--listen", f"unix:{audio_socket}"])
        script = (GUEST_SCRIPT.replace("__TEXT__", known).replace("__MIB__", str(READ_MIB))
                  .replace("__READS__", str(READS)).replace("__AUDIO_SECONDS__", str(AUDIO_SECONDS)))
        consumer = guest.Guest("redir-consumer", script, timeout=900, qemu_args=[
            "-device", "qemu-xhci,id=xhci", "-qmp", f"unix:{monitor_path},server=on,wait=off"])
        monitor = Monitor(monitor_path)

        def guest_check(name, timeout=300):
            line = consumer.wait_for(f"@@CHECK {name} ", timeout)
            checks.check(f"guest: {name}", " PASS" in line, line)

        for path, plug_at in [("bridge", bridge_socket), ("usbredirect", redirect_port)]:
            consumer.wait_for(f"@@PLUG {path}", 180)
            if path == "usbredirect":
                # The drive goes back to the exporter's kernel, and usbredirect takes it from there.
                rc, out = remote.run(f"usbwire unbind -b {busid} $C")
                checks.check("the exporter's usbwire serve gives the drive back", rc == 0, out)
                rc, out = remote.run(
                    f"usbredirect --device {':'.join(STICK)} --as 0.0.0.0:{REDIRECT_PORT} > /tmp/usbredirect.log 2>&1 & "
                    f"i=0; while ! grep -q ':{REDIRECT_PORT:04X} 00000000:0000 0A' /proc/net/tcp && [ $i -lt 100 ]; "
                    f"do sleep 0.1; i=$((i+1)); done; grep -q ':{REDIRECT_PORT:04X} 00000000:0000 0A' /proc/net/tcp")
                checks.check("usbredirect listens in the exporter guest", rc == 0, out)
            plugged = monitor.plug_redir("redir-stick", f"rd-{path}", plug_at)
            checks.check(f"{path}: QEMU plugged the usb-redir device", plugged == "", plugged)
            for name in ["block-device", "mount", "file"]:
                guest_check(f"{path}-{name}")
            seconds = []
            for i in range(1, READS + 1):
                guest_check(f"{path}-read-{i}")
                _, t0, t1 = consumer.wait_for(f"@@READ {path} ", 60).split("@@READ ", 1)[1].split()
                seconds.append(float(t1) - float(t0))
            best = min(seconds)
            speeds[path] = READ_MIB / best if best > 0 else 0.0
            print(f"{path}: {READ_MIB} MiB raw reads in {', '.join(f'{s:.2f}' for s in seconds)} s "
                  f"(best {speeds[path]:.2f} MiB/s)", flush=True)
            consumer.wait_for(f"@@UNPLUG {path}", 60)
            monitor.execute("device_del", id="redir-stick")
            guest_check(f"{path}-gone")
            if path == "bridge":
                checks.check("the bridge released its import when the guest unplugged",
                             bridge_log.wait_count("guest disconnected; device released", 1, 30), bridge_log.tail())
                deadline = time.time() + 15
                while time.time() < deadline and (listed(port) or {}).get("state", "available") != "available":
                    time.sleep(0.2)
                seen = listed(port) or {}
                if seen.get("state", "available") != "available":
                    _, serve_log = remote.run("grep -v -e 'device list' -e 'device state' /tmp/serve.log | tail -n 40")
                    checks.check("the exporter lists the drive available again", False,
                                 f"listed {seen}; the exporter's serve log: {serve_log}")
                else:
                    checks.check("the exporter lists the drive available again", True, "")
        consumer.wait_for("@@PLUG audio", 120)
        plugged = monitor.plug_redir("redir-audio", "rd-audio", audio_socket)
        checks.check("audio: QEMU plugged the usb-redir device", plugged == "", plugged)
        guest_check("audio-pcm")
        played = consumer.wait_for("@@PCMPLAY", 120)
        guest_check("audio-play")
        frames = 48000 * AUDIO_SECONDS
        checks.check(f"the guest played {frames} frames", f"{frames} frames" in played, played)
        consumer.wait_for("@@UNPLUG audio", 60)
        monitor.execute("device_del", id="redir-audio")
        guest_check("audio-gone")
        audio_log.wait_count("guest traffic", 1, 30)
        found = re.search(r"guest traffic.*iso_out_packets=(\d+)", audio_log.text())
        packets = int(found.group(1)) if found else 0
        # Full speed: one packet per 1 ms frame while the stream runs.
        checks.check(f"audio: >= {int(800 * AUDIO_SECONDS)} isochronous packets reached the speaker through the bridge",
                     packets >= 800 * AUDIO_SECONDS, f"{packets} packets; {audio_log.tail()}")
        print(f"audio: {packets} isochronous OUT packets through the bridge for {AUDIO_SECONDS} s", flush=True)
        dmesg = consumer.collect("@@DMESG-BEGIN", "@@DMESG-END", 60)
        checks.check("no I/O error in the consumer's kernel log", "I/O error" not in dmesg, dmesg)
        checks.check("consumer script exit code", consumer.finish(60) == 0, "")
        checks.check("bridge: no malformed packet or failure",
                     bridge_log.count("malformed") == 0 and bridge_log.count("ERROR") == 0, bridge_log.tail())
        if len(speeds) == 2 and speeds["usbredirect"] > 0:
            print(f"raw read through the bridge: {speeds['bridge']:.2f} MiB/s, through usbredirect: "
                  f"{speeds['usbredirect']:.2f} MiB/s (ratio {speeds['bridge'] / speeds['usbredirect']:.2f})",
                  flush=True)
    except Exception as error:  # a wait that timed out is a failure with a reason
        checks.check("test ran to the end", False, str(error))
    finally:
        remote.close()
        for g in (consumer, exporter):
            if g:
                g.kill()
        for proc in (bridge, audio_bridge):
            if proc:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
        print(f"logs: {guest.LOGS}/redir-exporter.*, redir-consumer.*, redir.real-bridge.log", flush=True)
    checks.exit()


if __name__ == "__main__":
    main()
