"""The socket to the server: connect, say hello, send and receive frames.

The socket is the one the server was started with (``usbwire serve --virtual
external=unix:PATH``). Where to find it, first that applies: the ``path``
argument, the ``USBWIRE_DEVICE_SOCKET`` environment variable,
:func:`default_socket_path`.
"""

from __future__ import annotations

import os
import select
import socket
import time
from typing import List, Optional

from . import codec

#: Bytes read from the socket at a time; with a frame's maximum, what the input buffer may hold.
READ_SIZE = 1 << 16
#: How long the server has to answer the hello (it reads the descriptors right after).
HELLO_TIMEOUT = 5.0


class DeviceProtocolError(Exception):
    """The connection to the server broke the device protocol, or could not be made."""


class Refused(DeviceProtocolError):
    """The server refused the device and closed the connection; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"refused by the usbwire server: {reason}")
        self.reason = reason


class ServerClosed(DeviceProtocolError):
    """The server closed the connection (it stopped, or withdrew the device)."""


def default_socket_path() -> str:
    """``/run/usbwire/device.sock`` for root; else ``$XDG_RUNTIME_DIR/usbwire/device.sock``
    (``/tmp/usbwire-UID/device.sock`` without XDG_RUNTIME_DIR)."""
    if os.geteuid() == 0:
        return "/run/usbwire/device.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "usbwire", "device.sock")
    return f"/tmp/usbwire-{os.geteuid()}/device.sock"


def socket_path(path: Optional[str] = None) -> str:
    """Where to connect: ``path``, else ``$USBWIRE_DEVICE_SOCKET``, else :func:`default_socket_path`."""
    return path or os.environ.get("USBWIRE_DEVICE_SOCKET") or default_socket_path()


class Connection:
    """One connection to the server, after its WELCOME."""

    def __init__(self, path: Optional[str] = None, *, speed: int, ep0_max_packet: int) -> None:
        self.path = socket_path(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.connect(self.path)
        except OSError as error:
            self.sock.close()
            raise DeviceProtocolError(
                f"cannot connect to the device socket {self.path}: {error.strerror or error}; start "
                f"`usbwire serve --virtual external=unix:{self.path}` first, or set USBWIRE_DEVICE_SOCKET"
            ) from error
        self.input = bytearray()
        self.max_frame_len = codec.MAX_FRAME_LEN
        self.backlog: List[codec.Message] = []
        self.send(codec.Hello(codec.VERSION, speed, ep0_max_packet))
        deadline = time.monotonic() + HELLO_TIMEOUT
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise DeviceProtocolError(f"the server at {self.path} did not answer the hello within {HELLO_TIMEOUT} s")
            messages = self.receive(left)
            for at, message in enumerate(messages):
                if isinstance(message, codec.Welcome):
                    self.max_frame_len = message.max_frame_len
                    self.backlog = messages[at + 1 :]
                    return
                self.close()
                raise DeviceProtocolError(f"the server sent {message!r} before WELCOME")

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: codec.Message) -> None:
        frame = codec.encode(message)
        if len(frame) - 4 > self.max_frame_len:
            raise DeviceProtocolError(f"a frame of {len(frame) - 4} bytes is over the server's maximum {self.max_frame_len}")
        try:
            self.sock.sendall(frame)
        except (BrokenPipeError, ConnectionResetError) as error:
            # A server that refuses says why before it closes: find its REFUSE among what it sent.
            while True:
                try:
                    if not self.receive(0.5):
                        break
                except DeviceProtocolError as closed:
                    raise closed from error
            raise ServerClosed(f"the server at {self.path} closed the connection") from error

    def receive(self, timeout: Optional[float]) -> List[codec.Message]:
        """The whole frames that arrive within ``timeout`` seconds (None: wait for some), maybe none.

        Raises :class:`Refused` on REFUSE, :class:`ServerClosed` when the server closes.
        """
        if self.backlog:
            messages, self.backlog = self.backlog, []
            return messages
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            return []
        try:
            chunk = self.sock.recv(READ_SIZE)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            raise ServerClosed(f"the server at {self.path} closed the connection")
        self.input += chunk
        messages = []
        try:
            while (message := codec.decode(self.input)) is not None:
                if isinstance(message, codec.Refuse):
                    raise Refused(message.reason)
                messages.append(message)
        except codec.CodecError as error:
            raise DeviceProtocolError(f"the server at {self.path} sent a bad frame: {error}") from error
        return messages

    def close(self) -> None:
        self.sock.close()
