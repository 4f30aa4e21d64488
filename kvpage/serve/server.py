"""Serving a `Gateway` with uvicorn: connections held within limits, and SIGTERM drains
instead of closing the port.

**Connections** (`ConnectionLimits`, the config's `server` section). uvicorn limits none
of what an exposed server meets first: idle sockets until the file descriptors run
out, headers sent a byte at a time, header blocks of any size. `GuardedProtocol` is
uvicorn's httptools protocol with those limits added: at most `max_connections` open
(at the cap, a new connection closes the connection idle longest, one with no request
in progress, and is refused at accept only when every connection has one); a
request's head (its line and headers) within `header_timeout_s` and
`max_header_bytes`, at most `max_headers` headers (408 and 431, then the connection
closes); malformed HTTP gets a 400 and a close, logged nowhere. The body's own timeout
and cap are the application's (`kvpage.serve.app`).

uvicorn's own shutdown stops listening at once, so a client arriving during a drain
would see a refused connection, which tells it nothing. Here the first SIGTERM or
SIGINT starts `Gateway.drain`: the port stays open, new requests get a 503 `draining`
with a retry hint, live requests run for up to `drain_timeout_s` and the rest are
aborted; then uvicorn shuts down and the process exits 0. A second signal stops at once.
"""

import asyncio
import collections
import dataclasses
import errno
import json
import resource
import socket
import sys
from types import FrameType
from typing import Any

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from kvpage.serve import protocol
from kvpage.serve.app import Gateway, make_app

LINGER_S = 2.0  # after a refusal, unread input is drained this long before closing
FD_RESERVE = 256  # descriptors kept for what is not a client connection
MAX_AUTO_CONNECTIONS = 16384


@dataclasses.dataclass(frozen=True)
class ConnectionLimits:
  """How many connections, and how long and how large a request's head may be."""

  max_connections: int = 1024
  header_timeout_s: float = 10.0
  keep_alive_s: float = 5.0
  max_headers: int = 100
  max_header_bytes: int = 65536

  @classmethod
  def from_config(cls, server: Any) -> "ConnectionLimits":
    """The limits a `server` section sets; `max_connections` 0 raises the process's
    file-descriptor limit to its hard limit and keeps `FD_RESERVE` of them spare."""
    connections = server.max_connections or _descriptor_budget()
    return cls(max_connections=connections, header_timeout_s=server.header_timeout_s,
               keep_alive_s=server.keep_alive_s, max_headers=server.max_headers,
               max_header_bytes=server.max_header_bytes)


def _descriptor_budget() -> int:
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  wanted = hard if hard != resource.RLIM_INFINITY else MAX_AUTO_CONNECTIONS + FD_RESERVE
  if soft != resource.RLIM_INFINITY and soft < wanted:
    try:
      resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
      soft = wanted
    except (ValueError, OSError):
      pass  # keep the soft limit
  budget = MAX_AUTO_CONNECTIONS if soft == resource.RLIM_INFINITY else soft - FD_RESERVE
  return max(16, min(MAX_AUTO_CONNECTIONS, budget))


class ConnectionBook:
  """One server's open connections; the idle ones (no request in progress) in the order
  they went idle, the first evicted when a new connection meets the cap."""

  def __init__(self, limits: ConnectionLimits):
    self.limits = limits
    self.members: set[Any] = set()
    self.idle: collections.OrderedDict[Any, None] = collections.OrderedDict()
    self.refused = 0  # connections closed at accept: the cap, every one busy
    self.evicted = 0  # idle connections closed to make room

  def admit(self, connection: Any) -> bool:
    """Whether `connection` may stay open: under the cap, or once an idle one is closed."""
    if len(self.members) >= self.limits.max_connections:
      if not self.idle:
        self.refused += 1
        return False
      oldest, _ = self.idle.popitem(last=False)
      self.members.discard(oldest)
      self.evicted += 1
      oldest.transport.close()
    self.members.add(connection)
    self.idle[connection] = None
    return True

  def busy(self, connection: Any) -> None:
    self.idle.pop(connection, None)

  def rest(self, connection: Any) -> None:
    if connection in self.members:
      self.idle[connection] = None
      self.idle.move_to_end(connection)

  def forget(self, connection: Any) -> None:
    self.members.discard(connection)
    self.idle.pop(connection, None)


class _HeadRefusedError(Exception):
  """Raised from a parser callback: the request's head broke a limit."""


class GuardedProtocol(HttpToolsProtocol):
  """uvicorn's httptools protocol within `ConnectionLimits` (see the module's doc);
  `protocol_class` binds it to one server's `ConnectionBook`."""

  book: ConnectionBook

  def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
    self._head_timer: asyncio.TimerHandle | None = None
    self._head_bytes, self._reading_head, self._num_headers, self._heads = 0, True, 0, 0
    self._refusal: tuple[int, str] | None = None
    self._lingering = False
    if not self.book.admit(self):
      self.transport = transport  # for uvicorn's connection_lost
      transport.close()
      return
    super().connection_made(transport)
    self._arm_head_timer()

  def connection_lost(self, exc: Exception | None) -> None:
    self.book.forget(self)
    if self._head_timer is not None:
      self._head_timer.cancel()
    super().connection_lost(exc)

  def data_received(self, data: bytes) -> None:
    if self._lingering or self.transport.is_closing():
      return  # refused: what still comes is read and dropped
    self._unset_keepalive_if_required()
    counted, heads = self._reading_head, self._heads
    try:
      self.parser.feed_data(data)
    except httptools.HttpParserUpgrade:
      self._unsupported_upgrade_warning()  # no websockets here
      return
    except httptools.HttpParserError:
      status, message = self._refusal or (400, "the request is not valid HTTP/1.1")
      self._refuse(status, message)
      return
    if counted and self._heads == heads:  # still the same head
      self._head_bytes += len(data)
      if self._head_bytes > self.book.limits.max_header_bytes:
        self._refuse(431, f"the request's line and headers exceed "
                     f"{self.book.limits.max_header_bytes:,} bytes")

  def on_message_begin(self) -> None:
    super().on_message_begin()
    self._num_headers = 0
    if self._head_timer is None:
      self._arm_head_timer()

  def on_header(self, name: bytes, value: bytes) -> None:
    self._num_headers += 1
    if self._num_headers > self.book.limits.max_headers:
      self._refusal = (431, f"the request has more than {self.book.limits.max_headers} "
                       "headers")
      raise _HeadRefusedError()
    super().on_header(name, value)

  def on_headers_complete(self) -> None:
    self._reading_head = False
    self._heads += 1
    if self._head_timer is not None:
      self._head_timer.cancel()
      self._head_timer = None
    self.book.busy(self)
    super().on_headers_complete()

  def on_message_complete(self) -> None:
    super().on_message_complete()
    self._reading_head, self._head_bytes = True, 0  # what comes next is the next head

  def on_response_complete(self) -> None:
    super().on_response_complete()
    if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
      self.book.rest(self)  # no request in progress: evictable

  def _arm_head_timer(self) -> None:
    self._head_timer = self.loop.call_later(self.book.limits.header_timeout_s,
                                            self._head_timeout)

  def _head_timeout(self) -> None:
    self._head_timer = None
    if self._reading_head and not self.transport.is_closing():
      self._refuse(408, f"the request's headers did not arrive within "
                   f"{self.book.limits.header_timeout_s:g} s")

  def _refuse(self, status: int, message: str) -> None:
    """Answers `status` in OpenAI's error shape and closes the connection: first its
    sending side, then, once the client stops sending or `LINGER_S` passed, the rest (a
    socket closed with unread input resets, and the reset can destroy the answer
    before the client reads it)."""
    body = json.dumps(protocol.error_body(message, "invalid_request_error")).encode()
    self.transport.write(b"".join([
        STATUS_LINE[status], b"content-type: application/json\r\n",
        b"content-length: " + str(len(body)).encode() + b"\r\n",
        b"connection: close\r\n\r\n", body]))
    self.book.busy(self)  # not evictable, not counted as idle: it is going
    if self._lingering or not self.transport.can_write_eof():
      self.transport.close()
      return
    try:
      self.transport.write_eof()
    except OSError:  # the client is gone already (reset): nothing to linger for
      self.transport.close()
      return
    self._lingering = True
    self.loop.call_later(LINGER_S, self.transport.close)


def protocol_class(limits: ConnectionLimits) -> type[GuardedProtocol]:
  """`GuardedProtocol` bound to a new `ConnectionBook` (one per server)."""
  return type("GuardedProtocol", (GuardedProtocol,), {"book": ConnectionBook(limits)})


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


def check_address(host: str, port: int) -> None:
  """Raises `ValueError` (one line) unless this process could listen on `host:port`
  now: checked before minutes of warm-up, not after."""
  try:
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
  except (socket.gaierror, UnicodeError) as error:
    raise ValueError(f"cannot listen on {host}:{port}: the host does not resolve "
                     f"({getattr(error, 'strerror', None) or error})") from None
  with socket.socket(family, kind, proto) as probe:
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
      probe.bind(address)
    except OSError as error:
      raise ValueError(f"cannot listen on {host}:{port}: {error.strerror or error}"
                       + (" (another server holds the port?)"
                          if error.errno == errno.EADDRINUSE else "")) from None


def serve(gateway: Gateway, *, host: str, port: int, banner: str = "",
          limits: ConnectionLimits = ConnectionLimits()) -> None:
  """Serves until drained; raises `ValueError` if the address cannot be bound."""
  config = uvicorn.Config(make_app(gateway), host=host, port=port, log_level="warning",
                          access_log=False, loop="asyncio", lifespan="on",
                          http=protocol_class(limits),
                          timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]
                          timeout_graceful_shutdown=5)
  server = DrainingServer(config, gateway, banner)
  try:
    server.run()
  except OSError as error:
    raise ValueError(f"cannot listen on {host}:{port}: {error}") from None
  if not server.started:
    raise ValueError(f"the server did not start on {host}:{port} (is the port taken?)")
