"""The serving loop of a device (a :class:`~usbwire.device.core.Device`): requests in, answers out.

Requests wait in one queue per endpoint (ep0's control requests in one, each
OUT and IN endpoint in its own) and are answered oldest first, as the protocol
wants final answers in the order of an endpoint's requests. A request whose
handler says NAK gets the NAK as its first answer and is asked again every
poll until it has a final one.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Deque, Dict, Optional, Protocol, Set

from . import codec
from .connection import Connection
from .handlers import NAK, STALL, InHandler, OutHandler, Reply, SetupPacket


class Served(Protocol):
    """What the loop needs of a device: a :class:`~usbwire.device.core.Device` is one."""

    stopping: bool
    halted: Set[int]
    out_handlers: Dict[int, OutHandler]
    in_handlers: Dict[int, InHandler]

    def control(self, setup: SetupPacket, data: bytes) -> Reply: ...

    def reset(self) -> None: ...


class Server:
    def __init__(self, device: Served, connection: Connection) -> None:
        self.device = device
        self.connection = connection
        # Key: 0 for ep0, the endpoint address otherwise (0x02 OUT, 0x81 IN).
        self.queues: Dict[int, Deque[codec.Message]] = {}
        self.naked: set = set()

    def run(self, tick: Optional[Callable[[], None]], poll: float) -> None:
        next_tick = time.monotonic()
        while not self.device.stopping:
            waiting = any(self.queues.values())
            timeout = poll if waiting or tick else None
            for message in self.connection.receive(timeout):
                self.take(message)
            if tick and time.monotonic() >= next_tick:
                tick()
                next_tick = time.monotonic() + poll
            for key, queue in self.queues.items():
                while queue and self.answer(queue[0]):
                    queue.popleft()

    def take(self, message: codec.Message) -> None:
        if isinstance(message, codec.Setup):
            self.queues.setdefault(0, deque()).append(message)
        elif isinstance(message, codec.Out):
            self.queues.setdefault(message.endpoint, deque()).append(message)
        elif isinstance(message, codec.In):
            self.queues.setdefault(0x80 | message.endpoint, deque()).append(message)
        elif isinstance(message, codec.Cancel):
            for queue in self.queues.values():
                for waiting in [w for w in queue if w.id == message.id]:
                    queue.remove(waiting)
            self.naked.discard(message.id)
        elif isinstance(message, codec.Reset):
            self.queues.clear()
            self.naked.clear()
            self.device.reset()

    def answer(self, request: codec.Message) -> bool:
        """Asks the handler; sends its answer; True when that answer is final."""
        reply = self.ask(request)
        if reply is NAK:
            if request.id not in self.naked:
                self.naked.add(request.id)
                self.connection.send(codec.Nak(request.id))
            return False
        self.naked.discard(request.id)
        self.connection.send(self.final(request, reply))
        return True

    def ask(self, request: codec.Message) -> Reply:
        device = self.device
        if isinstance(request, codec.Setup):
            return device.control(SetupPacket.parse(request.setup), request.data)
        if (request.endpoint | (0x80 if isinstance(request, codec.In) else 0)) in device.halted:
            return STALL
        if isinstance(request, codec.Out):
            handler = device.out_handlers.get(request.endpoint)
            return handler(request.data) if handler else STALL
        handler = device.in_handlers.get(request.endpoint)
        return handler(request.length) if handler else STALL

    @staticmethod
    def final(request: codec.Message, reply: Reply) -> codec.Message:
        if reply is STALL:
            return codec.Stall(request.id)
        if isinstance(request, codec.In):
            return codec.Data(request.id, bytes(reply or b""))
        if isinstance(request, codec.Setup):
            setup = SetupPacket.parse(request.setup)
            if setup.is_in and setup.length > 0:
                return codec.Data(request.id, bytes(reply or b"")[: setup.length])
        if reply:
            what = "OUT data" if isinstance(request, codec.Out) else "a control request without an IN data stage"
            raise TypeError(f"a handler of {what} returned {len(reply)} bytes: return None (done), NAK or STALL")
        return codec.Ack(request.id)
