"""A fake HTTP engine for the adapter and sidecar tests: one aiohttp app that answers every path
with the subclass's ``_handle`` on a free loopback port (``url`` once started)."""

from __future__ import annotations

from aiohttp import web


class CatchAllServer:
    """Subclasses implement ``_handle(request)``; ``start`` binds 127.0.0.1 on a free port."""

    url = ""
    _runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raise NotImplementedError

    async def start(self):  # noqa: ANN201 - returns the subclass instance
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()
