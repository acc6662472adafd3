#!/usr/bin/env python3
"""A TCP proxy on host loopback that cuts its connections on command, for
tests of sessions that must survive a broken network path.

    proxy = CutProxy(("127.0.0.1", server_port))
    port = proxy.start()              # listens on 127.0.0.1:port, forwards to the server
    proxy.cut("rst")                  # every live connection: RST to both ends
    proxy.cut("fin")                  #   ... or an orderly close (FIN) to both ends
    proxy.cut("blackhole")            #   ... or nothing either way for a while, then RST
    proxy.cut("server-rst")           #   ... or RST to the server only; the client's side
                                      #       stays open and silent (a link lost beyond its
                                      #       own network: nothing tells the client)
    proxy.cut("stall")                #   ... or nothing either way, both sides left open
                                      #       (a pulled cable); RST only `silent_seconds` later
    proxy.stats()                     # connections accepted, cuts made, per-connection detail

    CutProxy(upstream, delay=0.025)   # a long link: every chunk is held 25 ms in each
                                      # direction (50 ms round trip), never reordered

New connections are always accepted and forwarded, also while older ones sit
in a black hole. The proxy runs an asyncio loop on its own thread; every
public method is called from other threads.

    python3 tests/interop/cutproxy.py selftest     # the cuts and the delay against a local echo server
"""

import asyncio
import socket
import struct
import sys
import threading
import time

MODES = ("rst", "fin", "blackhole", "server-rst", "stall")
# The cuts that tell the client nothing: only its own timers can notice them.
SILENT_MODES = ("server-rst", "stall")


class _Conn:
    def __init__(self, ident, client_reader, client_writer):
        self.id = ident
        self.accepted = time.time()
        self.client = (client_reader, client_writer)
        self.server = None
        self.up = 0  # bytes client -> server
        self.down = 0  # bytes server -> client
        self.state = "connecting"  # connecting, live, holed, closed
        self.ended_by = None  # "rst", "fin", "blackhole", "client", "server", "connect-failed"
        self.closed_at = None
        self.tasks = []

    def writers(self):
        out = [self.client[1]]
        if self.server:
            out.append(self.server[1])
        return out

    def info(self):
        return {"id": self.id, "accepted": self.accepted, "state": self.state, "up": self.up, "down": self.down,
                "ended_by": self.ended_by, "closed_at": self.closed_at}


def _reset(writer):
    """Closes with SO_LINGER {1, 0}: the kernel sends RST, not FIN."""
    sock = writer.get_extra_info("socket")
    try:
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    writer.transport.abort()


class CutProxy:
    def __init__(self, upstream, hole_seconds=5.0, listen_host="127.0.0.1", silent_seconds=40.0, delay=0.0):
        self.upstream = upstream
        # Seconds each chunk is held in each direction. A chunk leaves at its arrival plus
        # `delay`, or when the chunk before it left if that is later, so bytes keep their order.
        self.delay = delay
        self.hole_seconds = hole_seconds
        # How long a silent cut keeps the sockets it leaves open: beyond a server's 30 s grace.
        self.silent_seconds = silent_seconds
        self.listen_host = listen_host
        self.port = None
        self.conns = []
        self.cuts = []  # (time, mode, connections cut)
        self._loop = None
        self._server = None
        self._thread = None

    # -- called from other threads ------------------------------------------------

    def start(self):
        ready = threading.Event()

        def run():
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._accept, self.listen_host, 0, backlog=128))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="cutproxy", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("cut proxy did not start")
        return self.port

    def stop(self):
        if self._loop and self._loop.is_running():
            self._call(self._close_all())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def cut(self, mode):
        """Cuts every live connection the given way; returns how many it cut.
        A black hole returns at once: its RST follows `hole_seconds` later."""
        if mode not in MODES:
            raise ValueError(f"unknown cut {mode!r}")
        return self._call(self._cut(mode))

    def stats(self):
        """{'connections': accepted, 'cuts': cuts that hit at least one connection,
        'conns': [per-connection info], 'cut_log': [(time, mode, n)]}"""
        return self._call(self._stats())

    def wait_new_connection(self, after_id, timeout, min_down=1, settle=0.3):
        """The first connection with an id above `after_id` that is live, has carried
        bytes both ways (at least `min_down` towards the client) and stayed up for
        `settle` seconds; None after `timeout`."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            for c in self.stats()["conns"]:
                if (c["id"] > after_id and c["state"] == "live" and c["up"] > 0 and c["down"] >= min_down
                        and time.time() - c["accepted"] >= settle):
                    return c
            time.sleep(0.1)
        return None

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    # -- on the proxy's loop --------------------------------------------------------

    async def _stats(self):
        return {"connections": len(self.conns), "cuts": sum(1 for _, _, n in self.cuts if n > 0),
                "conns": [c.info() for c in self.conns], "cut_log": list(self.cuts)}

    async def _accept(self, reader, writer):
        conn = _Conn(len(self.conns) + 1, reader, writer)
        self.conns.append(conn)
        try:
            server = await asyncio.wait_for(asyncio.open_connection(*self.upstream), 10)
        except (OSError, asyncio.TimeoutError):
            conn.state, conn.ended_by, conn.closed_at = "closed", "connect-failed", time.time()
            _reset(writer)
            return
        if conn.state != "connecting":  # cut while connecting
            _reset(server[1])
            return
        for w in (writer, server[1]):
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.server = server
        conn.state = "live"
        done = {"up": False, "down": False}

        async def pump(src, dst, direction):
            try:
                while True:
                    data = await src.read(256 * 1024)
                    if not data:
                        # Half-close onwards, like TCP itself would.
                        if dst.can_write_eof():
                            dst.write_eof()
                        done[direction] = True
                        if all(done.values()):
                            self._finish(conn, "client" if direction == "up" else "server")
                        return
                    setattr(conn, direction, getattr(conn, direction) + len(data))
                    dst.write(data)
                    await dst.drain()
            except asyncio.CancelledError:
                raise
            except (OSError, RuntimeError):
                broken(direction)

        def broken(direction):
            # One end reset: so does the other.
            if conn.state == "live":
                for w in conn.writers():
                    _reset(w)
                self._finish(conn, "client" if direction == "up" else "server")

        async def delayed_pump(src, dst, direction):
            """`pump` through a queue: the reader stamps each chunk with its release time
            and reads on; the sender holds each chunk until then. The end of the stream
            (None) is released the same way, after the bytes before it."""
            loop = asyncio.get_running_loop()
            held = asyncio.Queue()

            async def send():
                try:
                    while True:
                        release, data = await held.get()
                        wait = release - loop.time()
                        if wait > 0:
                            await asyncio.sleep(wait)
                        if data is None:
                            if dst.can_write_eof():
                                dst.write_eof()
                            done[direction] = True
                            if all(done.values()):
                                self._finish(conn, "client" if direction == "up" else "server")
                            return
                        dst.write(data)
                        await dst.drain()
                except asyncio.CancelledError:
                    raise
                except (OSError, RuntimeError):
                    broken(direction)

            sender = asyncio.ensure_future(send())
            conn.tasks.append(sender)
            last = 0.0
            try:
                while True:
                    data = await src.read(256 * 1024)
                    last = max(loop.time() + self.delay, last)
                    held.put_nowait((last, data or None))
                    if not data:
                        return
                    setattr(conn, direction, getattr(conn, direction) + len(data))
            except asyncio.CancelledError:
                sender.cancel()
                raise
            except (OSError, RuntimeError):
                sender.cancel()
                broken(direction)

        relay = delayed_pump if self.delay > 0 else pump
        conn.tasks = [asyncio.ensure_future(relay(reader, server[1], "up")),
                      asyncio.ensure_future(relay(server[0], writer, "down"))]

    def _finish(self, conn, ended_by):
        if conn.state in ("live", "connecting"):
            conn.state, conn.ended_by, conn.closed_at = "closed", ended_by, time.time()
            for w in conn.writers():
                w.close()

    async def _cut(self, mode):
        victims = [c for c in self.conns if c.state in ("live", "connecting")]
        for conn in victims:
            for task in conn.tasks:
                task.cancel()
            conn.ended_by = mode
            if mode == "rst":
                conn.state, conn.closed_at = "closed", time.time()
                for w in conn.writers():
                    _reset(w)
            elif mode == "fin":
                conn.state, conn.closed_at = "closed", time.time()
                for w in conn.writers():
                    if w.can_write_eof():
                        w.write_eof()
                # Read and drop whatever still arrives, so the close that follows stays
                # a FIN (closing with unread data would send RST).
                asyncio.ensure_future(self._drain_then_close(conn))
            elif mode == "server-rst":
                conn.state = "holed"
                if conn.server:
                    _reset(conn.server[1])
                conn.client[1].transport.pause_reading()
                asyncio.ensure_future(self._hole_then_reset(conn, self.silent_seconds, [conn.client[1]]))
            else:
                conn.state = "holed"
                for w in conn.writers():
                    w.transport.pause_reading()
                hold = self.hole_seconds if mode == "blackhole" else self.silent_seconds
                asyncio.ensure_future(self._hole_then_reset(conn, hold, conn.writers()))
        self.cuts.append((time.time(), mode, len(victims)))
        return len(victims)

    async def _drain_then_close(self, conn):
        async def drain(reader):
            try:
                while await reader.read(65536):
                    pass
            except OSError:
                pass

        readers = [conn.client[0]] + ([conn.server[0]] if conn.server else [])
        try:
            await asyncio.wait_for(asyncio.gather(*(drain(r) for r in readers)), 5)
        except asyncio.TimeoutError:
            pass
        for w in conn.writers():
            w.close()

    async def _hole_then_reset(self, conn, seconds, writers):
        await asyncio.sleep(seconds)
        if conn.state == "closed":
            return
        conn.state, conn.closed_at = "closed", time.time()
        for w in writers:
            _reset(w)

    async def _close_all(self):
        self._server.close()
        for conn in self.conns:
            for task in conn.tasks:
                task.cancel()
            if conn.state != "closed":
                conn.state, conn.closed_at = "closed", time.time()
                for w in conn.writers():
                    _reset(w)


def selftest():
    """Each cut as an echo server's peer sees it. Returns [(name, ok, detail)]."""
    results = []
    ends = []  # how the upstream side of each connection ended
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)

    def echo(conn):
        try:
            while True:
                data = conn.recv(65536)
                if not data:
                    ends.append("eof")
                    return
                conn.sendall(data)
        except ConnectionResetError:
            ends.append("reset")
        except OSError as error:
            ends.append(f"error {error}")
        finally:
            conn.close()

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    proxy = CutProxy(listener.getsockname(), hole_seconds=0.6, silent_seconds=0.9)
    port = proxy.start()

    def client():
        s = socket.create_connection(("127.0.0.1", port), timeout=3)
        s.sendall(b"ping")
        got = b""
        while len(got) < 4:
            got += s.recv(4)
        return s, got

    def outcome(s):
        try:
            data = s.recv(16)
            return "eof" if data == b"" else f"data {data!r}"
        except ConnectionResetError:
            return "reset"
        except socket.timeout:
            return "timeout"
        finally:
            s.close()

    def after_sending(s):
        """Sends a few bytes through a cut connection: what comes back within 0.4 s."""
        s.sendall(b"lost")
        s.settimeout(0.4)
        try:
            return f"data {s.recv(16)!r}"
        except socket.timeout:
            return "silent"
        except OSError as error:
            return repr(error)

    def wait_ends(n):
        deadline = time.time() + 3
        while len(ends) < n and time.time() < deadline:
            time.sleep(0.02)
        return ends[n - 1] if len(ends) >= n else "nothing"

    try:
        s, got = client()
        results.append(("proxy forwards both ways", got == b"ping", repr(got)))
        n = proxy.cut("rst")
        seen = outcome(s)
        results.append(("proxy rst: both ends see a reset", n == 1 and seen == "reset" and wait_ends(1) == "reset",
                        f"cut {n}, client {seen}, server {wait_ends(1)}"))
        s, _ = client()
        n = proxy.cut("fin")
        seen = outcome(s)
        results.append(("proxy fin: both ends see an orderly close", n == 1 and seen == "eof" and wait_ends(2) == "eof",
                        f"cut {n}, client {seen}, server {wait_ends(2)}"))
        s, _ = client()
        n = proxy.cut("blackhole")
        during = after_sending(s)
        s.settimeout(3)
        seen = outcome(s)
        results.append(("proxy blackhole: silence, then a reset to both ends",
                        n == 1 and during == "silent" and seen == "reset" and wait_ends(3) == "reset",
                        f"cut {n}, during the hole {during}, then client {seen}, server {wait_ends(3)}"))
        s, _ = client()
        n = proxy.cut("server-rst")
        server_end = wait_ends(4)
        during = after_sending(s)
        s.close()
        results.append(("proxy server-rst: the server sees a reset, the client silence",
                        n == 1 and server_end == "reset" and during == "silent",
                        f"cut {n}, server {server_end}, client {during}"))
        s, _ = client()
        n = proxy.cut("stall")
        during = after_sending(s)
        early = ends[4] if len(ends) > 4 else "nothing"
        s.settimeout(3)
        seen = outcome(s)
        results.append(("proxy stall: silence with both ends open, a reset only much later",
                        n == 1 and during == "silent" and early == "nothing" and seen == "reset"
                        and wait_ends(5) == "reset", f"cut {n}, during {during}, server meanwhile {early}, "
                        f"then client {seen}, server {wait_ends(5)}"))
        s, got = client()
        stats = proxy.stats()
        results.append(("proxy accepts after cuts and counts", got == b"ping" and stats["connections"] == 6
                        and stats["cuts"] == 5, f"{stats['connections']} connections, {stats['cuts']} cuts"))
        s.close()
    except Exception as error:  # noqa: BLE001 - reported as a failed check
        results.append(("proxy self-test ran", False, repr(error)))
    finally:
        proxy.stop()
    results += delay_selftest(listener.getsockname())
    listener.close()
    return results


def delay_selftest(echo_addr, delay=0.05):
    """The delay against the echo server at `echo_addr`: a round trip takes at least twice
    `delay`, and a stream written in many small pieces comes back whole and in order."""
    results = []
    proxy = CutProxy(echo_addr, delay=delay)
    port = proxy.start()
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        trips = []
        for _ in range(5):
            started = time.monotonic()
            s.sendall(b"ping")
            got = b""
            while len(got) < 4:
                got += s.recv(4 - len(got))
            trips.append(time.monotonic() - started)
        results.append((f"proxy delay {delay * 1000:.0f} ms: each echo round trip takes at least {2 * delay * 1000:.0f} ms",
                        min(trips) >= 2 * delay and got == b"ping",
                        "round trips " + ", ".join(f"{t * 1000:.1f} ms" for t in trips)))
        # 2 MiB of numbered bytes in 2000 writes, some right behind each other and some
        # spaced, read back concurrently: every byte, in order.
        sent = b"".join(i.to_bytes(4, "big") * 256 for i in range(2048))
        received = bytearray()

        def read_back():
            while len(received) < len(sent):
                data = s.recv(65536)
                if not data:
                    return
                received.extend(data)

        reader = threading.Thread(target=read_back, daemon=True)
        reader.start()
        started = time.monotonic()
        for i in range(0, len(sent), 1024):
            s.sendall(sent[i:i + 1024])
            if i % (64 * 1024) == 0:
                time.sleep(0.003)
        reader.join(30)
        took = time.monotonic() - started
        results.append(("proxy delay keeps the order: 2 MiB in 2048 writes comes back byte for byte",
                        bytes(received) == sent and took >= 2 * delay,
                        f"{len(received)} of {len(sent)} bytes back, first difference at "
                        f"{next((i for i, (a, b) in enumerate(zip(received, sent)) if a != b), min(len(received), len(sent)))}, "
                        f"{took:.2f} s"))
        s.close()
    except Exception as error:  # noqa: BLE001 - reported as a failed check
        results.append(("proxy delay self-test ran", False, repr(error)))
    finally:
        proxy.stop()
    return results


if __name__ == "__main__":
    if sys.argv[1:] == ["selftest"]:
        bad = 0
        for name, ok, detail in selftest():
            print(f"{'PASS' if ok else 'FAIL'} {name}{'' if ok else ': ' + detail}")
            bad += not ok
        sys.exit(1 if bad else 0)
    print(__doc__)
