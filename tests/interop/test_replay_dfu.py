#!/usr/bin/env python3
"""A board's bootloader recorded while dfu-util flashed it, replayed to dfu-util: Debian's
dfu-util in a vhci-hcd guest flashes `usbwire serve --virtual dfu=FILE --capture DIR` as
test_dfu.py does (DFU_DETACH, the bootloader, manifestation: three imports, one recording
each). The server stops, and a replay server serves each recording twice, strictly
(`--virtual replay=…,mode=strict`). The guest attaches the first replay of the bootloader
(1209:0007) and runs the same `dfu-util -a 0 -D` of the same image; then the second, with
another image. Then a VM with no usbip (its own xHCI controller, a `usb-redir` device dialling
a `usbwire redir` bridge that imports a third replay of the bootloader) runs the same download
of the same image.

Checked: the recording's flash worked (FILE holds the image); dfu-util downloads the same
image to the replayed bootloader with exit status 0 and the replay's report has 0 divergences;
with another image the report's first divergence is a DFU_DNLOAD whose data differs from the
recording (`control 21 01 …`), stalled, and dfu-util fails; through the bridge the VM's dfu-util
flashes the replayed bootloader as the recorded one (test_dfu_redir's measure of success) and
that replay's report has 0 divergences.

Run: python3 tests/interop/test_replay_dfu.py   (USBWIRE_BIN=path/to/usbwire)
"""

import hashlib
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import guest  # noqa: E402
from test_dfu import BOOTLOADER, PRELUDE, RUNTIME  # noqa: E402
from test_dfu_redir import download_succeeded  # noqa: E402
from test_replay_kernel import listening  # noqa: E402

BIN = guest.BIN

SCRIPT = PRELUDE + r"""
detach_all() {
  for p in $(usbwire port --json | tr ',{}' '\n\n\n' | sed -n 's/.*"port":\([0-9]*\).*/\1/p'); do usbwire detach -p $p; done
}
# Recording: the board flashed through its re-enumerations, followed.
usbwire attach --follow -r 10.0.2.2:__RECORD__ -b 0-1 > /tmp/attach.out 2>&1; check record-attach $? "$(cat /tmp/attach.out)"
wait_device __RUNTIME__; check record-runtime $?
dfu-util -a 0 -D /fw.bin > /tmp/download.out 2>&1; check record-download $? "$(tail -5 /tmp/download.out)"
wait_device __RUNTIME__; check record-runtime-back $?
detach_all
echo "@@RECORDED"
# Replay: the replayed bootloaders, in the order the replay server lists them.
wait_for "usbwire list -r 10.0.2.2:__REPLAY__ 2>/dev/null | grep -q '__BOOTLOADER__'" 1800; check replay-listed $?
set -- $(usbwire list -r 10.0.2.2:__REPLAY__ | grep '__BOOTLOADER__' | sed 's/^ *\([0-9]*-[0-9]*\):.*/\1/')
echo "@@BOOTLOADERS $*"
# replay NAME BUSID IMAGE: dfu-util downloads IMAGE to the replayed bootloader BUSID.
replay() {
  usbwire attach -r 10.0.2.2:__REPLAY__ -b $2 > /tmp/attach.out 2>&1; check $1-attach $? "$(cat /tmp/attach.out)"
  wait_device __BOOTLOADER__; check $1-bootloader $?
  dfu-util -a 0 -D $3 > /tmp/$1.out 2>&1; rc=$?
  echo "@@$1-BEGIN"; tail -8 /tmp/$1.out; echo "@@$1-END"
  echo "@@$1-RC $rc"
  detach_all
  i=0; while devices | grep -q "=__BOOTLOADER__" && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done
}
replay same $1 /fw.bin
replay other $2 /other.bin
kill $WATCH
echo "@@DONE"
exit 0
"""

# The bridge's VM: dfu-util downloads the same image to the bootloader its xHCI controller sees.
BRIDGE_SCRIPT = PRELUDE + r"""
wait_device __BOOTLOADER__; check bridge-bootloader $?
dfu-util -a 0 -D /fw.bin > /tmp/bridge.out 2>&1; rc=$?
echo "@@bridge-BEGIN"; cat /tmp/bridge.out; echo "@@bridge-END"
echo "@@bridge-RC $rc"
kill $WATCH
echo "@@DONE"
exit 0
"""


def through_the_bridge(checks, work, replay_port, busid, image, report):
    """A fresh VM flashes `image` to the replayed bootloader `busid` through a usbredir bridge;
    the replay's report (`report`, written as the bridge's import ends) has no divergence."""
    socket_path = os.path.join(work, "bridge.sock")
    bridge = None
    g = None
    try:
        with open(os.path.join(guest.LOGS, "replay-dfu.bridge.log"), "w") as out:
            bridge, redir_args = guest.redir_bridge(replay_port, busid, socket_path, out, wait=30)
        checks.check("bridge: the bridge listens", os.path.exists(socket_path), socket_path)
        g = guest.Guest("replay-dfu-redir", BRIDGE_SCRIPT.replace("__BOOTLOADER__", BOOTLOADER),
                        files={image: "/fw.bin"}, timeout=600,
                        qemu_args=["-device", "qemu-xhci,id=xhci"] + redir_args)
        for step in ["udevd", "bridge-bootloader"]:
            line = g.wait_for(f"@@CHECK {step} ", 300)
            checks.check(f"bridge guest: {step}", " PASS" in line, line)
        said = g.collect("@@bridge-BEGIN", "@@bridge-END", 300)
        rc = int(g.wait_for("@@bridge-RC", 60).split()[-1])
        print(f"dfu-util -D through the bridge, exit {rc}:\n{said}", flush=True)
        ok, why = download_succeeded(rc, said)
        checks.check("bridge: dfu-util in the VM flashes the replayed bootloader", ok, why)
        g.wait_for("@@DONE", 120)
        checks.check("bridge guest script exit code", g.finish(60) == 0)
    finally:
        if g:
            g.kill()
        # The bridge's import ends: the replay writes its report.
        guest.stop([bridge] if bridge else [])
    deadline = time.time() + 10
    while not os.path.exists(report) and time.time() < deadline:
        time.sleep(0.1)
    text = open(report).read() if os.path.exists(report) else ""
    print(f"through the bridge, replay report:\n{text}", flush=True)
    loaded = json.loads(text) if text else {}
    checks.check("bridge: the replay's report has 0 divergences", loaded.get("divergences") == 0,
                 json.dumps(loaded.get("first_divergences"), indent=1) if loaded else "no report")


def main():
    guest.require(BIN, "/usr/bin/dfu-util")
    guest.build()
    checks = guest.Checks()
    work = guest.scratch("usbwire-replay-dfu-")
    firmware, image, other = (os.path.join(work, name) for name in ("fw.bin", "image.bin", "other.bin"))
    data = os.urandom(64 << 10)
    for path, content in ((image, data), (other, data[:4096] + os.urandom(len(data) - 4096))):
        with open(path, "wb") as f:
            f.write(content)
    capture_dir = os.path.join(work, "capture")
    record_port, replay_port = guest.free_port(), guest.free_port()
    logs = {name: os.path.join(guest.LOGS, f"replay-dfu.{name}.log") for name in ("record", "replay")}
    servers = []
    g = None
    started = time.time()
    try:
        with open(logs["record"], "w") as out:
            servers.append(subprocess.Popen(
                [BIN, "serve", "-v", "--listen", f"127.0.0.1:{record_port}", "--no-advertise",
                 "--control", os.path.join(work, "record.sock"), "--capture", capture_dir,
                 "--virtual", f"dfu={firmware}"], stdout=out, stderr=subprocess.STDOUT))
        checks.check("the recording server listens", listening(record_port, servers[0]), logs["record"])
        script = (SCRIPT.replace("__RECORD__", str(record_port)).replace("__REPLAY__", str(replay_port))
                  .replace("__RUNTIME__", RUNTIME).replace("__BOOTLOADER__", BOOTLOADER))
        g = guest.Guest("replay-dfu", script, files={BIN: "/usr/bin/usbwire", image: "/fw.bin", other: "/other.bin"},
                        timeout=900)
        for step in ["udevd", "record-attach", "record-runtime", "record-download", "record-runtime-back"]:
            line = g.wait_for(f"@@CHECK {step} ", 300)
            checks.check(f"guest: {step}", " PASS" in line, line)
        g.wait_for("@@RECORDED", 120)
        guest.stop(servers)
        servers = []
        with open(firmware, "rb") as f:
            checks.check("record: the board holds the image dfu-util flashed",
                         hashlib.sha256(f.read()).digest() == hashlib.sha256(data).digest())
        files = sorted(os.listdir(capture_dir), key=lambda name: os.stat(os.path.join(capture_dir, name)).st_mtime)
        print(f"recordings: {files}", flush=True)
        checks.check("one recording per import: runtime, bootloader, runtime", len(files) == 3, files)
        reports = []
        replays = []
        for copy in range(3):
            for i, name in enumerate(files):
                reports.append(os.path.join(work, f"report-{copy}-{i}.json"))
                replays += ["--virtual", f"replay={os.path.join(capture_dir, name)},mode=strict,report={reports[-1]}"]
        with open(logs["replay"], "w") as out:
            servers.append(subprocess.Popen(
                [BIN, "serve", "-v", "--listen", f"127.0.0.1:{replay_port}", "--no-advertise",
                 "--control", os.path.join(work, "replay.sock")] + replays, stdout=out, stderr=subprocess.STDOUT))
        checks.check("the replay server listens", listening(replay_port, servers[0]), logs["replay"])
        line = g.wait_for("@@CHECK replay-listed ", 300)
        checks.check("guest: replay-listed", " PASS" in line, line)
        busids = g.wait_for("@@BOOTLOADERS", 60).split()[1:]
        checks.check("the replay server lists the recorded bootloader three times", len(busids) == 3, busids)
        results = {}
        for name in ("same", "other"):
            for step in ["attach", "bootloader"]:
                line = g.wait_for(f"@@CHECK {name}-{step} ", 300)
                checks.check(f"guest: {name}-{step}", " PASS" in line, line)
            said = g.collect(f"@@{name}-BEGIN", f"@@{name}-END", 300)
            rc = int(g.wait_for(f"@@{name}-RC", 60).split()[-1])
            print(f"dfu-util -D, {name} image, exit {rc}:\n{said}", flush=True)
            results[name] = rc
        g.wait_for("@@DONE", 120)
        checks.check("guest script exit code", g.finish(60) == 0)
        g.kill()
        g = None
        through_the_bridge(checks, work, replay_port, busids[2], image,
                           reports[int(busids[2].split("-")[1]) - 1])
        guest.stop(servers)
        servers = []
        # The replay server numbers its devices 0-1, 0-2, … in the order of `replays`, as `reports`.
        loaded = {}
        for name, busid in zip(("same", "other"), busids):
            path = reports[int(busid.split("-")[1]) - 1]
            text = open(path).read() if os.path.exists(path) else ""
            print(f"{name} image, replay report:\n{text}", flush=True)
            loaded[name] = json.loads(text) if text else {}
        checks.check("dfu-util downloads the same image to the replayed bootloader (exit 0)", results.get("same") == 0,
                     results)
        checks.check("the same image's replay has 0 divergences", loaded["same"].get("divergences") == 0,
                     json.dumps(loaded["same"].get("first_divergences"), indent=1))
        first = (loaded["other"].get("first_divergences") or [{}])[0]
        checks.check("another image: the first divergence is a DFU_DNLOAD whose data differs, stalled",
                     first.get("request", "").startswith("control 21 01") and first.get("answered") == "stall"
                     and "differs" in first.get("reason", ""), json.dumps(first))
        checks.check("another image: dfu-util fails", results.get("other", 0) != 0, results)
    except Exception as error:  # noqa: BLE001 - a wait that timed out is a failure with a reason
        checks.check("the test ran to the end", False, error)
    finally:
        if g:
            g.kill()
        guest.stop(servers)
    print(f"test ran {time.time() - started:.1f} s; logs: {guest.LOGS}/replay-dfu.*", flush=True)
    checks.exit()


if __name__ == "__main__":
    main()
