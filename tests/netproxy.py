"""A TCP proxy on 127.0.0.1 that makes a local storage server behave like one across a
network, and misbehave like a busy one.

Local servers answer in microseconds over loopback at memory speed, so they cannot show
what parallel requests are for: a real store is tens of milliseconds away and one TCP
connection carries tens of MB/s. Put this proxy between a client and a real server
(rclone, moto, the GCS emulator) and every connection gets:

* ``latency``: seconds added to every round trip. Each direction's bytes are delayed by
  half of it, in order (as a network delay line does), so a request and its answer
  cost ``latency`` more, and a connection's new request waits for the old answer.
* ``bandwidth``: bytes per second each connection may carry in each direction (a
  token bucket), with at most ``window`` bytes in flight per direction, so a client
  that sends faster than the cap is held back by TCP as it would be on a real link.

And, for a fraction of the HTTP requests it forwards (the proxy parses requests, never
responses beyond their headers), chosen with a seeded random generator:

* ``slowdown``: answered ``503 SlowDown`` (S3's throttling reply, an XML body; GCS
  clients read the status) without reaching the server; the connection is then closed.
* ``stall``: the request goes out (its body is read and dropped), its answer never
  comes back (the part "hangs"), until the client gives up and closes.
* ``reset``: a request with a body is cut after half of it, a request without one after
  half of its answer's body (before the answer, when the answer has no body: HEAD,
  204, 304, empty); both connections are then reset (RST, not FIN).
* ``lost``: the whole request reaches the server, which acts on it, but the connection
  is reset before any of the answer comes back (the client cannot tell whether it
  took effect: the case that idempotent commits are for).

``methods`` limits the faults to some HTTP methods (uploads are PUT and POST), ``path``
to the requests whose target (path and query) contains the given text.

For a test that needs an exact count rather than a share: ``slowdown_first`` = N answers
the first N requests the faults apply to ``503 SlowDown`` (counted as ``slowdown``),
whatever the shares and the seed; the shares apply to the requests after them.

Run it as a process (``python tests/netproxy.py --target http://127.0.0.1:PORT ...``;
it prints ``listening PORT`` when ready) or use :func:`proxied`, which does that and
yields the proxy's endpoint. On SIGTERM it writes what it did to ``--stats`` (JSON):
requests seen and faults injected, by kind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import random
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

CHUNK = 256 << 10
SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


@dataclasses.dataclass
class Settings:
    latency: float = 0.0
    bandwidth: float = 0.0  # bytes/s per connection and direction; 0: no cap
    window: int = 4 << 20
    slowdown: float = 0.0
    stall: float = 0.0
    reset: float = 0.0
    lost: float = 0.0
    methods: frozenset[str] = frozenset()
    path: str = ""
    slowdown_first: int = 0
    seed: int = 0


@dataclasses.dataclass
class Stats:
    connections: int = 0
    requests: int = 0
    slowdown: int = 0
    stall: int = 0
    reset: int = 0
    lost: int = 0
    bytes_up: int = 0
    bytes_down: int = 0


class Reset(Exception):
    """Cut both connections with a reset."""


class Close(Exception):
    """Close both connections once the client has its answer."""


class Link:
    """One direction of one connection: a delay line with a byte window and a rate cap."""

    def __init__(self, writer: asyncio.StreamWriter, settings: Settings, count: list[int]) -> None:
        self.writer, self.settings, self.count = writer, settings, count
        self.queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        self.in_flight = 0
        self.room = asyncio.Condition()
        self.next_free = 0.0
        self.sent = 0
        self.on_sent: list[tuple[int, asyncio.Future[None]]] = []

    async def put(self, data: bytes) -> None:
        """Queue ``data`` for delivery half a round trip from now; waits while the
        window is full."""
        async with self.room:
            await self.room.wait_for(lambda: self.in_flight < self.settings.window)
            self.in_flight += len(data)
        self.queue.put_nowait((time.monotonic() + self.settings.latency / 2, data))

    def close(self) -> None:
        self.queue.put_nowait(None)

    async def pump(self) -> None:
        """Deliver queued bytes in order, no earlier than their time, at most at the cap."""
        rate = self.settings.bandwidth
        while (item := await self.queue.get()) is not None:
            due, data = item
            now = time.monotonic()
            if due > now:
                await asyncio.sleep(due - now)
            if rate:
                start = max(time.monotonic(), self.next_free)
                self.next_free = start + len(data) / rate
                wait = self.next_free - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
            self.writer.write(data)
            await self.writer.drain()
            self.sent += len(data)
            self.count[0] += len(data)
            async with self.room:
                self.in_flight -= len(data)
                self.room.notify_all()
        with contextlib.suppress(OSError):
            self.writer.write_eof()


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class Connection:
    def __init__(self, proxy: Proxy, client_r, client_w, server_r, server_w) -> None:
        self.proxy, self.settings = proxy, proxy.settings
        self.client_r, self.client_w, self.server_r, self.server_w = client_r, client_w, server_r, server_w
        self.up = Link(server_w, self.settings, proxy.bytes_up)
        self.down = Link(client_w, self.settings, proxy.bytes_down)
        #: share of the next answer's body to let through before a reset; None: all of it
        self.cut_answer: float | None = None
        #: a stalled request: the server's answer is dropped, never delivered
        self.swallow = False

    def choose_fault(self, method: str, target: str) -> str | None:
        s = self.settings
        if s.methods and method not in s.methods:
            return None
        if s.path and s.path not in target:
            return None
        if self.proxy.first_left > 0:
            self.proxy.first_left -= 1
            return "slowdown"
        draw = self.proxy.random.random()
        for kind, share in (("slowdown", s.slowdown), ("stall", s.stall), ("reset", s.reset), ("lost", s.lost)):
            if draw < share:
                return kind
            draw -= share
        return None

    async def requests(self) -> None:
        """Parse the client's requests and forward them (or the chosen fault)."""
        reader = self.client_r
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as e:
                if e.partial:
                    await self.up.put(e.partial)
                self.up.close()  # the client is done: pass its FIN on
                return
            except asyncio.LimitOverrunError:
                raise Reset() from None
            self.proxy.stats.requests += 1
            lines = head.decode("latin-1").split("\r\n")
            method, _, rest = lines[0].partition(" ")
            method, target = method.upper(), rest.rpartition(" ")[0]
            headers = {":method": method}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0") or 0)
            chunked = "chunked" in headers.get("transfer-encoding", "").lower()
            fault = self.choose_fault(method, target)
            if fault:
                setattr(self.proxy.stats, fault, getattr(self.proxy.stats, fault) + 1)
            if fault == "slowdown":
                await self.slow_down(headers, length, chunked)
                return
            if fault == "stall":  # the request goes out, its answer never comes
                self.swallow = True
                await self.up.put(head)
                while await self.client_r.read(CHUNK):  # swallow the body until the client gives up
                    pass
                raise Reset()
            await self.up.put(head)
            if fault == "reset" and not (length or chunked):
                self.cut_answer = 0.0 if method == "HEAD" else 0.5  # an answer to HEAD has no body to cut
            elif fault == "lost":
                self.cut_answer = 0.0
            cut = length // 2 if fault == "reset" and length else None
            if chunked:
                await self.forward_chunked(cut_now=fault == "reset")
            else:
                await self.forward(length, cut)

    async def forward(self, length: int, cut: int | None) -> None:
        left = length
        while left:
            data = await self.client_r.read(min(CHUNK, left))
            if not data:
                return
            if cut is not None and length - left + len(data) >= cut:
                await self.up.put(data[: max(cut - (length - left), 0)])
                await asyncio.sleep(self.settings.latency / 2 + 0.05)
                raise Reset()
            left -= len(data)
            await self.up.put(data)

    async def forward_chunked(self, *, cut_now: bool) -> None:
        reader = self.client_r
        while True:
            size_line = await reader.readuntil(b"\r\n")
            await self.up.put(size_line)
            size = int(size_line.split(b";")[0].strip(), 16)
            if cut_now and size:
                raise Reset()
            if size == 0:
                while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
                    await self.up.put(line)
                await self.up.put(line)
                return
            await self.forward(size + 2, None)

    async def slow_down(self, headers: dict[str, str], length: int, chunked: bool) -> None:
        if not chunked and "100-continue" not in headers.get("expect", "").lower():
            left = length
            while left:
                data = await self.client_r.read(min(CHUNK, left))
                if not data:
                    break
                left -= len(data)
        body = b"" if headers.get(":method") == "HEAD" else SLOWDOWN_BODY  # an answer to HEAD has no body
        answer = (
            b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
            b"Retry-After: 0\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        await self.down.put(answer)
        while self.down.in_flight:
            await asyncio.sleep(0.005)
        raise Close()

    async def answers(self) -> None:
        """Forward the server's bytes to the client; cut a marked answer (``cut_answer``)."""
        counted = -1  # bytes of a marked answer seen so far; -1: none marked
        header = b""
        cut_at = None
        while data := await self.server_r.read(CHUNK):
            if self.swallow or self.cut_answer == 0.0:  # stalled or lost: no byte of the answer gets through
                if data.startswith(b"HTTP/1.1 100 ") and b"\r\n\r\n" in data:  # "send the body": not the answer
                    interim, _, data = data.partition(b"\r\n\r\n")
                    await self.down.put(interim + b"\r\n\r\n")
                    if not data:
                        continue
                if self.swallow:
                    continue
                raise Reset()
            if self.cut_answer is not None and counted < 0:
                counted, header, cut_at = 0, b"", None
            if counted >= 0:
                if cut_at is None:
                    header += data
                    end = header.find(b"\r\n\r\n")
                    if end < 0:
                        await self.down.put(data)
                        continue
                    length = 0
                    lines = header[:end].decode("latin-1").split("\r\n")
                    for line in lines[1:]:
                        name, _, value = line.partition(":")
                        if name.strip().lower() == "content-length":
                            length = int(value.strip() or 0)
                    status = int(lines[0].split(" ")[1]) if len(lines[0].split(" ")) > 1 else 0
                    if length == 0 or status < 200 or status in (204, 304):
                        raise Reset()  # no body to cut in half: cut before the answer
                    cut_at = end + 4 + length // 2
                    counted = len(header) - len(data)
                if counted + len(data) >= cut_at:
                    await self.down.put(data[: cut_at - counted])
                    await asyncio.sleep(self.settings.latency / 2 + 0.05)
                    raise Reset()
                counted += len(data)
            await self.down.put(data)
        if self.swallow:  # the server is done, but a stalled answer never ends: hold the client
            await asyncio.Event().wait()
        self.down.close()

    async def run(self) -> None:
        """Until both sides are done, or either side or the fault logic ends the connection
        (a pump whose peer went away ends it too, so nothing waits on a dead socket)."""
        pumps = [asyncio.create_task(self.up.pump()), asyncio.create_task(self.down.pump())]
        parts = [asyncio.create_task(self.requests()), asyncio.create_task(self.answers())]
        try:
            done, _ = await asyncio.wait(parts + pumps, return_when=asyncio.FIRST_EXCEPTION)
            errors = [task.exception() for task in done if not task.cancelled() and task.exception()]
            if any(not isinstance(e, Close) for e in errors):
                _reset(self.client_w)
                _reset(self.server_w)
        finally:
            for task in parts + pumps:
                task.cancel()
            await asyncio.gather(*parts, *pumps, return_exceptions=True)
            for w in (self.client_w, self.server_w):
                with contextlib.suppress(OSError, RuntimeError):
                    w.close()


class Proxy:
    def __init__(self, target_host: str, target_port: int, settings: Settings) -> None:
        self.target = (target_host, target_port)
        self.settings = settings
        self.random = random.Random(settings.seed)
        #: requests still to answer 503 under ``slowdown_first``
        self.first_left = settings.slowdown_first
        self.stats = Stats()
        self.bytes_up, self.bytes_down = [0], [0]
        self.tasks: set[asyncio.Task] = set()

    async def handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        task = asyncio.current_task()
        if task is not None:
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        try:
            server_r, server_w = await asyncio.open_connection(*self.target, limit=CHUNK * 4)
        except OSError:
            client_w.transport.abort()
            return
        with contextlib.suppress(asyncio.CancelledError):  # cancelled when the proxy stops
            await Connection(self, client_r, client_w, server_r, server_w).run()


async def serve(target: str, settings: Settings, stats_path: str | None, port: int = 0) -> None:
    host, _, target_port = target.removeprefix("http://").rstrip("/").partition(":")
    proxy = Proxy(host, int(target_port), settings)
    server = await asyncio.start_server(proxy.handle, "127.0.0.1", port, limit=CHUNK * 4)
    print(f"listening {server.sockets[0].getsockname()[1]}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    await stop.wait()
    server.close()
    for task in list(proxy.tasks):  # connections still open: end them before the loop closes
        task.cancel()
    await asyncio.gather(*proxy.tasks, return_exceptions=True)
    if stats_path:
        proxy.stats.bytes_up, proxy.stats.bytes_down = proxy.bytes_up[0], proxy.bytes_down[0]
        Path(stats_path).write_text(json.dumps(dataclasses.asdict(proxy.stats)))


@contextlib.contextmanager
def proxied(endpoint: str, *, stats: Path | None = None, **settings) -> Iterator[str]:
    """Run a proxy in front of ``endpoint`` (``http://127.0.0.1:PORT``) for a block;
    yields the proxy's endpoint. ``settings`` are :class:`Settings` fields (``methods``
    a set of method names). With ``stats``, the proxy's counts are written there when
    the block ends."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--target", endpoint]
    for name, value in settings.items():
        if name == "methods":
            value = ",".join(sorted(value))
        argv += [f"--{name.replace('_', '-')}", str(value)]
    if stats is not None:
        argv += ["--stats", str(stats)]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline() if process.stdout else ""
        if not line.startswith("listening "):
            raise RuntimeError(f"proxy did not start: {line!r}")
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def read_stats(path: Path) -> Stats:
    return Stats(**json.loads(path.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="http://127.0.0.1:PORT of the real server")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--latency", type=float, default=0.0, help="seconds added to each round trip")
    parser.add_argument("--bandwidth", type=float, default=0.0, help="bytes/s per connection and direction")
    parser.add_argument("--window", type=int, default=4 << 20, help="bytes in flight per direction")
    parser.add_argument("--slowdown", type=float, default=0.0, help="share of requests answered 503 SlowDown")
    parser.add_argument("--stall", type=float, default=0.0, help="share of requests that hang")
    parser.add_argument("--reset", type=float, default=0.0, help="share of requests reset mid-body")
    parser.add_argument("--lost", type=float, default=0.0, help="share of requests whose answer is lost")
    parser.add_argument("--methods", default="", help="comma-separated methods the faults apply to (default all)")
    parser.add_argument("--path", default="", help="faults apply only to requests whose target contains this")
    parser.add_argument(
        "--slowdown-first", type=int, default=0, help="answer the first N requests the faults apply to 503 SlowDown"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stats", default=None, help="write counts here (JSON) on SIGTERM")
    args = parser.parse_args()
    settings = Settings(
        latency=args.latency,
        bandwidth=args.bandwidth,
        window=args.window,
        slowdown=args.slowdown,
        stall=args.stall,
        reset=args.reset,
        lost=args.lost,
        methods=frozenset(m.upper() for m in args.methods.split(",") if m),
        path=args.path,
        slowdown_first=args.slowdown_first,
        seed=args.seed,
    )
    asyncio.run(serve(args.target, settings, args.stats, args.port))


if __name__ == "__main__":
    main()
