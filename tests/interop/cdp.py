#!/usr/bin/env python3
"""A small Chrome DevTools Protocol client, standard library only: headless
Chromium with --remote-debugging-port, one page, JavaScript evaluated in it
and screenshots taken while it runs live. (`chromium --dump-dom` and
`--screenshot` snapshot a page at its load event, before a live page has
received anything from its event stream.)

    with cdp.Browser(CHROMIUM) as browser:
        page = browser.open("http://127.0.0.1:8324/", width=1200, height=500)
        time.sleep(5)
        page.evaluate("document.title")
        page.screenshot("shot.png")
"""

import base64
import json
import os
import socket
import struct
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Browser:
    """Headless Chromium on a loopback debugging port, in a throwaway profile; stopped on exit."""

    def __init__(self, chromium):
        self.port = _free_port()
        self.profile = tempfile.mkdtemp(prefix="usbwire-chromium-")
        self.process = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             f"--remote-debugging-port={self.port}", f"--user-data-dir={self.profile}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/json/version", timeout=2):
                    return
            except OSError:
                if time.time() > deadline or self.process.poll() is not None:
                    self.close()
                    raise RuntimeError("headless Chromium did not open its debugging port")
                time.sleep(0.2)

    def open(self, url, width=1200, height=500):
        """A new tab at `url`, its viewport `width` x `height` CSS pixels at scale 1."""
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/json/new?{urllib.parse.quote(url, safe=':/?=&')}", method="PUT")
        with urllib.request.urlopen(request, timeout=10) as reply:
            target = json.loads(reply.read())
        page = Page(target["webSocketDebuggerUrl"])
        page.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        return page

    def close(self):
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        subprocess.run(["rm", "-rf", self.profile], check=False)

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.close()


class Page:
    """One tab, driven over its DevTools websocket (RFC 6455 framing, client frames masked)."""

    def __init__(self, ws_url):
        parsed = urllib.parse.urlparse(ws_url)
        self.sock = socket.create_connection((parsed.hostname, parsed.port), timeout=30)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {parsed.path} HTTP/1.1\r\nHost: {parsed.hostname}:{parsed.port}\r\n"
                           f"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                           "Sec-WebSocket-Version: 13\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(1)
            if not chunk:
                raise RuntimeError("the DevTools websocket closed during its handshake")
            head += chunk
        if b" 101 " not in head.split(b"\r\n", 1)[0]:
            raise RuntimeError(f"no websocket: {head[:200]!r}")
        self.next_id = 0

    def _exact(self, n):
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise RuntimeError("the DevTools websocket closed")
            data += chunk
        return data

    def _send(self, text):
        payload = text.encode()
        header = bytes([0x81])
        if len(payload) < 126:
            header += bytes([0x80 | len(payload)])
        elif len(payload) < 1 << 16:
            header += bytes([0x80 | 126]) + struct.pack(">H", len(payload))
        else:
            header += bytes([0x80 | 127]) + struct.pack(">Q", len(payload))
        mask = os.urandom(4)
        self.sock.sendall(header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def _receive(self):
        """One whole text message (continuation frames joined)."""
        message = b""
        while True:
            first, second = self._exact(2)
            length = second & 0x7f
            if length == 126:
                length = struct.unpack(">H", self._exact(2))[0]
            elif length == 127:
                length = struct.unpack(">Q", self._exact(8))[0]
            payload = self._exact(length)
            opcode = first & 0x0f
            if opcode == 0x8:
                raise RuntimeError("the DevTools websocket was closed by the browser")
            if opcode in (0x1, 0x0):
                message += payload
                if first & 0x80:
                    return message.decode()

    def call(self, method, **params):
        """Sends one DevTools command and returns its result (events meanwhile are skipped)."""
        self.next_id += 1
        self._send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            answer = json.loads(self._receive())
            if answer.get("id") == self.next_id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer.get("result", {})

    def evaluate(self, expression):
        """The value of a JavaScript expression in the page (JSON-serialisable)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path):
        with open(path, "wb") as f:
            f.write(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))
