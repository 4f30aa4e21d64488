"""Serving a `Gateway` with uvicorn, where SIGTERM drains instead of closing the port.

uvicorn's own shutdown stops listening at once, so a client arriving during a drain
would see a refused connection, which tells it nothing. Here the first SIGTERM or
SIGINT starts `Gateway.drain`: the port stays open, new requests get a 503 `draining`
with a retry hint, live requests run for up to `drain_timeout_s` and the rest are
aborted; then uvicorn shuts down and the process exits 0. A second signal stops at once.
"""

import asyncio
import socket
import sys
from types import FrameType

import uvicorn

from kvpage.serve.app import Gateway, make_app


class DrainingServer(uvicorn.Server):
  """`uvicorn.Server` whose exit signals drain the gateway first."""

  def __init__(self, config: uvicorn.Config, gateway: Gateway, banner: str = ""):
    super().__init__(config)
    self.gateway = gateway
    self.banner = banner
    self._draining = False
    self._loop: asyncio.AbstractEventLoop | None = None

  async def startup(self, sockets: list[socket.socket] | None = None) -> None:
    self._loop = asyncio.get_running_loop()
    await super().startup(sockets)
    if self.started:  # the line tests and scripts wait for (a --port=0 port is known now)
      host, port = self.servers[0].sockets[0].getsockname()[:2]
      config = self.gateway.config
      print(f"kvpage serve: model {config.model_name!r} on http://{host}:{port} "
            f"(max_model_len {config.max_model_len}{', ' + self.banner if self.banner else ''})",
            flush=True)

  def handle_exit(self, sig: int, frame: FrameType | None) -> None:
    # Not uvicorn's: it would also re-raise the signal after shutdown, and a re-raised
    # SIGTERM under the default handler ends the process with status -15, not 0.
    del sig, frame
    if self._draining or self._loop is None:  # a second signal, or not started: stop now
      self.force_exit = self.should_exit
      self.should_exit = True
      return
    self._draining = True
    self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

  async def _drain(self) -> None:
    aborted = await self.gateway.drain()
    print(f"kvpage serve: drained; {aborted} requests aborted at the drain timeout",
          file=sys.stderr, flush=True)
    self.should_exit = True


def serve(gateway: Gateway, *, host: str, port: int, banner: str = "") -> None:
  """Serves until drained; raises `ValueError` if the address cannot be bound."""
  config = uvicorn.Config(make_app(gateway), host=host, port=port, log_level="warning",
                          access_log=False, loop="asyncio", lifespan="on",
                          timeout_graceful_shutdown=5)
  server = DrainingServer(config, gateway, banner)
  try:
    server.run()
  except OSError as error:
    raise ValueError(f"cannot listen on {host}:{port}: {error}") from None
  if not server.started:
    raise ValueError(f"the server did not start on {host}:{port} (is the port taken?)")
