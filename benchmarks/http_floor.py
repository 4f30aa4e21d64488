r"""The floor under any Python HTTP front-end: a bare ASGI app that answers at once.

  python -m benchmarks.http_floor   # prints "http_floor on http://127.0.0.1:PORT"

No framework, no engine, no tokenizer: every `POST /v1/completions` (or
`/v1/chat/completions`) is read whole and answered with one streamed OpenAI-style
chunk (`finish_reason` "length"), then `data: [DONE]`; `GET /v1/models` names one
model, "floor". It is served by uvicorn with the settings `kvpage.serve.server` uses
(asyncio loop, httptools parser), so the time from a client's send to that first
chunk is what the loopback socket, the HTTP parse on both sides and two event loops
cost before any gateway code runs. `benchmarks/http_overhead.py` measures it with the
same load client and cores as the real server, to show how much of the HTTP run's
extra time-to-first-token no gateway written this way could save.
"""

import json
import socket
from typing import Any

import uvicorn

_MODELS = json.dumps({"object": "list", "data": [{"id": "floor", "object": "model"}]}).encode()
_CHUNK = b"data: " + json.dumps({
    "id": "floor", "object": "text_completion", "created": 0, "model": "floor",
    "choices": [{"index": 0, "text": "x", "logprobs": None, "finish_reason": "length"}]},
    separators=(",", ":")).encode() + b"\n\n"


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
  """The ASGI app: `/v1/models`, and any POST answered with one chunk."""
  if scope["type"] == "lifespan":
    await receive()  # lifespan.startup
    await send({"type": "lifespan.startup.complete"})
    await receive()  # lifespan.shutdown
    await send({"type": "lifespan.shutdown.complete"})
    return
  if scope["type"] != "http":
    return
  while (await receive()).get("more_body"):  # the request body, read whole
    pass
  if scope["method"] == "GET":
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": _MODELS})
    return
  await send({"type": "http.response.start", "status": 200,
              "headers": [(b"content-type", b"text/event-stream")]})
  await send({"type": "http.response.body", "body": _CHUNK, "more_body": True})
  await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def main() -> None:
  listener = socket.socket()
  listener.bind(("127.0.0.1", 0))
  listener.listen(2048)  # connections queue from now on, so the printed URL works at once
  host, port = listener.getsockname()
  config = uvicorn.Config(app, log_level="warning", access_log=False, loop="asyncio",
                          lifespan="on")
  print(f"http_floor on http://{host}:{port} ", flush=True)
  uvicorn.Server(config).run(sockets=[listener])


if __name__ == "__main__":
  main()
