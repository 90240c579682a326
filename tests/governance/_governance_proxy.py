"""A TCP proxy in front of PostgreSQL that a test can stall or cut, to fail the network for real."""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit, urlunsplit


class TcpProxy:
    """Forwards 127.0.0.1:<port> to the DSN's server until :meth:`stall` or :meth:`cut`."""

    def __init__(self, dsn: str) -> None:
        parts = urlsplit(dsn)
        self._dsn = parts
        self._target = (parts.hostname or "127.0.0.1", parts.port or 5432)
        self._server: asyncio.Server | None = None
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        """Listen; return the DSN that goes through the proxy."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        netloc = self._dsn.netloc.rsplit("@", 1)
        host = f"127.0.0.1:{port}"
        netloc_text = f"{netloc[0]}@{host}" if len(netloc) == 2 else host
        return urlunsplit(self._dsn._replace(netloc=netloc_text))

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.close()
            return
        self._writers += [writer, up_writer]
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pump(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.CancelledError):
            while data := await src.read(65536):
                await self._flowing.wait()
                dst.write(data)
                await dst.drain()
        with contextlib.suppress(OSError):
            dst.close()

    def stall(self) -> None:
        """Keep connections open but forward nothing (a hung server or network)."""
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    async def cut(self) -> None:
        """Refuse new connections and drop every open one (the server went away)."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if server is not None:
            async with asyncio.timeout(5):
                await server.wait_closed()
