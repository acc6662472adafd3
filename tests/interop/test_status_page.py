#!/usr/bin/env python3
"""The status page, in a real browser: `usbwire serve --http` while a client
streams through the loopback device. Headless Chromium (Debian's `chromium`)
renders `/?once`: a row per device, the imported one "in_use" with its holder
and a URB count. The live page, followed for a few seconds through the
DevTools protocol (cdp.py), draws each device's throughput of the last minute
as a sparkline: the streamed device's rises, the idle keyboard's stays flat;
a screenshot of it is taken. The live updates are checked on the wire too:
`/events` sends the status every second, and the streamed device's byte
counters grow between messages.

    USBWIRE_BIN=target/release/usbwire python3 tests/interop/test_status_page.py
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cdp  # noqa: E402
import guest  # noqa: E402

BIN = guest.BIN
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def status(http):
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/status.json", timeout=10) as reply:
        return json.loads(reply.read())


def bulk_bytes(device):
    return sum(t["bytes"] for t in device.get("counters", {}).get("transfers", []) if t["transfer"] == "bulk")


def events(http, seconds):
    """The `data:` messages /events sends within `seconds`."""
    messages = []
    with socket.create_connection(("127.0.0.1", http), timeout=5) as s:
        s.sendall(b"GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n")
        buffer = b""
        deadline = time.time() + seconds
        while time.time() < deadline:
            s.settimeout(max(0.1, deadline - time.time()))
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                break
            if not chunk:
                break
            buffer += chunk
        head, _, body = buffer.partition(b"\r\n\r\n")
        for block in body.decode().split("\n\n"):
            if block.startswith("data: "):
                messages.append(json.loads(block[len("data: "):]))
    return head.decode(errors="replace"), messages


def main():
    guest.require(BIN, CHROMIUM)
    checks = guest.Checks()
    work = guest.scratch("usbwire-status-")
    os.makedirs(guest.LOGS, exist_ok=True)
    port, http = guest.free_port(), guest.free_port()
    log = open(os.path.join(guest.LOGS, "status-page.server.log"), "w")
    server = subprocess.Popen([BIN, "serve", "--listen", f"127.0.0.1:{port}", "--no-advertise", "--control",
                               os.path.join(work, "control.sock"), "--virtual", "loopback", "--virtual", "keyboard",
                               "--http", f"127.0.0.1:{http}"], stdout=log, stderr=subprocess.STDOUT)
    load = None
    try:
        for _ in range(100):
            try:
                status(http)
                break
            except OSError:
                time.sleep(0.1)
        # A client streams 64 KiB bulk URBs through the loopback device for a while.
        load = subprocess.Popen([BIN, "bench", "-r", f"127.0.0.1:{port}", "-b", "0-1", "--sizes", "64K",
                                 "--depths", "8", "--seconds", "3", "--repeat", "4"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 20
        while time.time() < deadline and status(http)["devices"][0]["state"] != "in_use":
            time.sleep(0.1)

        head, messages = events(http, 3.6)
        checks.check("/events is a server-sent event stream", "text/event-stream" in head, head)
        checks.check("/events sends the status every second", len(messages) >= 3, f"{len(messages)} messages")
        if len(messages) >= 2:
            gaps = [(b["time_ms"] - a["time_ms"]) / 1000 for a, b in zip(messages, messages[1:])]
            checks.check("one message a second", all(0.7 <= g <= 1.5 for g in gaps), gaps)
            streamed = [bulk_bytes(m["devices"][0]) for m in messages]
            checks.check("the streamed device's bytes grow between messages (live throughput)",
                         all(b > a for a, b in zip(streamed, streamed[1:])), streamed)

        dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
                              "--dump-dom", f"http://127.0.0.1:{http}/?once"],
                             capture_output=True, text=True, timeout=120).stdout

        def field(name):
            return re.findall(r'data-field="' + name + r'"[^>]*>([^<]*)<', dom)

        checks.check("the page lists both devices", field("busid") == ["0-1", "0-2"], field("busid"))
        checks.check("the streamed device is in use, the other available",
                     field("state") == ["in_use", "available"], field("state"))
        checks.check("the holder is shown", (field("holder") or [""])[0].startswith("127.0.0.1:"), field("holder"))
        urbs = field("urbs")
        checks.check("the page shows the URBs the device has completed", bool(urbs) and int(urbs[0]) > 0, urbs)
        checks.check("the page links the metrics", 'href="/metrics"' in dom, dom[:300])

        # The live page, followed for a while: a sparkline per device from the events.
        shot = os.path.join(guest.LOGS, "status-page.png")
        if os.path.exists(shot):
            os.remove(shot)
        with cdp.Browser(CHROMIUM) as browser:
            page = browser.open(f"http://127.0.0.1:{http}/", width=1200, height=500)
            time.sleep(6)
            sparks = page.evaluate("""[...document.querySelectorAll('[data-field="spark"]')].map(td => ({
                busid: td.parentElement.id.slice(4), samples: Number(td.dataset.samples),
                peak: Number(td.dataset.peak),
                points: (td.querySelector("polyline")?.getAttribute("points") || "").split(" ").filter(Boolean).length}))""")
            since = page.evaluate("""document.querySelector('[data-field="since"]').textContent""")
            page.screenshot(shot)
        by_busid = {s["busid"]: s for s in sparks or []}
        streamed, idle = by_busid.get("0-1", {}), by_busid.get("0-2", {})
        checks.check("each device has a sparkline of the last minute, a point per event",
                     streamed.get("samples", 0) >= 3 and idle.get("samples", 0) >= 3
                     and streamed.get("points", 0) == streamed.get("samples"), sparks)
        checks.check("the streamed device's sparkline shows its throughput", streamed.get("peak", 0) > 0, sparks)
        checks.check("the idle keyboard's sparkline is flat", idle.get("peak") == 0, sparks)
        checks.check("since is shown to the second, without milliseconds",
                     re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", since or "") is not None, since)
        png = open(shot, "rb").read() if os.path.exists(shot) else b""
        checks.check("a screenshot of the live page", png[:8] == b"\x89PNG\r\n\x1a\n"
                     and int.from_bytes(png[16:20], "big") == 1200, f"{len(png)} bytes")

        load.wait(120)
        deadline = time.time() + 10
        while time.time() < deadline and status(http)["devices"][0]["state"] != "available":
            time.sleep(0.1)
        checks.check("the device is available again after the client", status(http)["devices"][0]["state"] == "available")
    except Exception as error:  # a wait that timed out is a failure with a reason
        checks.check("test ran to the end", False, str(error))
    finally:
        if load and load.poll() is None:
            load.kill()
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    checks.exit()


if __name__ == "__main__":
    main()
