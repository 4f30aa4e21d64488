"""The FastAPI application: OpenAI's endpoints over one engine, holding the KV line.

  POST /v1/completions        prompt as text or token ids
  POST /v1/chat/completions   messages through the checkpoint's chat template
  GET  /v1/models, /health, /metrics

**Push-back at the door.** Each request is admitted or refused by the scheduler
(`EngineLoop.submit`) before its response starts, so a refusal is a real HTTP status:
400 (it can never run), 503 (cache pressure; `kv_pressure_status` makes it 429 for
proxies that eject upstreams answering 5xx), 429 (the queue is full, or the forecast
wait exceeds the request's deadline), 503 while draining. A 429/503 carries
`retry-after-ms` (the scheduler's estimate, in milliseconds) and `Retry-After` (whole
seconds, at least 1), both capped at 120 s, the longest the official `openai` client
waits; above the cap, `x-should-retry: false` tells that client not to retry at all.
`x-kvpage-reject-reason` says which line pushed back: `kv_pressure`, `queue_full`,
`wait_deadline` or `draining`.

**Streaming** is server-sent events in OpenAI's chunk format, ending `data: [DONE]`.
While an admitted request waits (never scheduled yet, or preempted), the stream
carries its status every `status_interval_s`: by default as an SSE comment line,
`: queueing position=3 waited_s=2.0 eta_s=4.1`, which spec-compliant clients ignore
(so the `openai` client works unchanged) and which keeps proxies from cutting a silent
stream; with `"stream_options": {"include_status": true}`, as a chunk with empty
`choices` and a `status` object (`state` queueing | running | preempted, `position`,
`waited_s`, `eta_s`: the forecast seconds until its first token, or its next once
preempted), the first at once when the request is admitted to wait (its ETA is the
forecast at admission). The ETA and the retry hints come from one estimator.

**Deadlines.** `max_queue_wait_s` (the body field, else the `x-kvpage-max-wait-s`
header, else the server's default) bounds the wait for the first step: a request
forecast to wait longer is refused with a 429 and a hint; one whose deadline passes
while it waits ends with an error event (or a 429, not streamed), its pages freed.

**Disconnects.** A client that goes away aborts its request; its pages are free
before the next step.

**Hostile input.** Nothing a client sends blocks the event loop or answers 5xx:
bodies must be JSON (`Content-Type`, else 415) within a cap sized from the model's
context (413) read within `body_timeout_s` (408); nesting past the parser's depth, a
number too long to read, a lone surrogate are 400s. Text is tokenized (and chat
templates rendered) on a small thread pool, after a pre-check that refuses, with no
tokenizer run, a prompt longer in characters than the context can hold in tokens.
With API keys set, `/v1/*` (and, with `open_probes` off, every path) needs
`Authorization: Bearer KEY` (401 otherwise); the `Host` header must name an allowed
host, and CORS answers only the allowed origins (`Door`, `make_app`). Connection
limits live in `kvpage.serve.server`.
"""

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hmac
import itertools
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

import fastapi
import prometheus_client
from fastapi import responses
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from kvpage.host.engine import Engine
from kvpage.interface import SERVICE_UNAVAILABLE, Admission
from kvpage.request import SamplingParams, TokenLogprobs
from kvpage.serve import protocol
from kvpage.serve.engine_loop import (
  Delta,
  EngineLoop,
  EngineStoppedError,
  QueueStatus,
  Stream,
  Submission,
)
from kvpage.serve.metrics import ServerMetrics
from kvpage.serve.protocol import ApiError, GenerationRequest

MAX_RETRY_AFTER_S = 120.0  # the official openai client waits at most this long
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
MAX_REQUEST_ID = 128
MAX_BODY_BYTES = 32 * 2**20  # the cap on any body, whatever the context
# A body's own cap: room for the fields, plus this many bytes per character (or token
# id) of the longest prompt the context can hold: JSON writes a character past the
# Basic Multilingual Plane as two `\\uXXXX` escapes, and an id as up to 10 digits and ", ".
BODY_BYTES_PER_CHAR = 12
BODY_SLACK_BYTES = 2**20
TOKENIZER_THREADS = 2  # text is tokenized here, off the event loop
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
LOOPBACK_ADDRESSES = ("127.0.0.1", "::1", "localhost")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
REPLICA_LOST = "the replica serving this request stopped"  # a fleet's (ray_fleet)


@dataclasses.dataclass(frozen=True)
class ServerConfig:
  """How the gateway answers; the engine's own policy lives in its scheduler config."""

  model_name: str
  max_model_len: int
  status_interval_s: float = 1.0
  max_queue_wait_s: float | None = None  # the default wait deadline
  kv_pressure_status: int = SERVICE_UNAVAILABLE  # or 429
  drain_timeout_s: float = 30.0
  eos_token_ids: tuple[int, ...] = ()
  # What computes the model's ops (`kvpage.device.backends.describe`), for /v1/models.
  backends: dict[str, Any] | None = None
  body_timeout_s: float = 30.0  # to read a request's body, from its headers' end
  # Who may come in (`Door`): any of these bearer keys (none: no key needed), also on
  # /health and /metrics unless `open_probes`; these Host header names ("*": any); and
  # CORS for these origins (none: no CORS headers, so browsers keep pages out).
  api_keys: tuple[str, ...] = ()
  open_probes: bool = True
  allowed_hosts: tuple[str, ...] = ("*",)
  allowed_origins: tuple[str, ...] = ()

  @classmethod
  def from_config(cls, server: Any, *, model_name: str, max_model_len: int,
                  eos_token_ids: tuple[int, ...] = (),
                  backends: dict[str, Any] | None = None,
                  api_keys: tuple[str, ...] = ()) -> "ServerConfig":
    """The gateway's answers as a config's `server` section sets them (`configs.base`),
    with what the served model says: its name, its longest sequence, its stop tokens
    and its backends; and the API keys (kept out of configs, which runs record)."""
    hosts = _names(server.allowed_hosts)
    if not hosts:  # bound to loopback: only loopback names (no DNS rebinding)
      hosts = LOOPBACK_NAMES if server.host in LOOPBACK_ADDRESSES else ("*",)
    return cls(model_name=server.get("served_model_name") or model_name,
               max_model_len=max_model_len,
               status_interval_s=server.status_interval_s,
               max_queue_wait_s=server.get("max_queue_wait_s"),
               kv_pressure_status=int(server.kv_pressure_status),
               drain_timeout_s=server.drain_timeout_s, eos_token_ids=eos_token_ids,
               backends=backends, body_timeout_s=server.body_timeout_s,
               api_keys=tuple(api_keys), open_probes=server.open_probes,
               allowed_hosts=hosts, allowed_origins=_names(server.allowed_origins))


def _names(listed: str) -> tuple[str, ...]:
  """A comma-separated list of a config's field."""
  return tuple(name.strip() for name in listed.split(",") if name.strip())


def push_back_headers(retry_after_s: float | None, reason: str, *,
                      retry: bool = True, request_id: str | None = None) -> dict[str, str]:
  """The headers of a 429/503: the hint in two units that agree (`Retry-After` is the
  ceiling of `retry-after-ms` in whole seconds), capped, whether to retry here at all
  (not past the cap, nor when `retry` is False), which line said no, and the
  `x-request-id` the request holds its place in line under (a retry that sends it back
  keeps that place)."""
  headers = {"x-kvpage-reject-reason": reason}
  if request_id is not None:
    headers["x-request-id"] = request_id
  if retry_after_s is None:
    return headers
  capped = min(max(retry_after_s, 0.0), MAX_RETRY_AFTER_S)
  milliseconds = max(1, math.ceil(capped * 1000))
  headers["retry-after-ms"] = str(milliseconds)
  headers["Retry-After"] = str(math.ceil(milliseconds / 1000))
  headers["x-should-retry"] = ("true" if retry and retry_after_s <= MAX_RETRY_AFTER_S
                               else "false")
  return headers


def longest_token_chars(tokenizer: Any) -> int:
  """The most characters one token of `tokenizer` can stand for: its longest token
  string (a byte-level token's string has one character per byte, at least one per
  character it decodes to), so a text longer than `n` times this cannot be `n` tokens."""
  tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
  return max([len(token) for token in tokens if token] + [1])


class Loop(Protocol):
  """The engine side as the gateway's handlers see it (`EngineLoop` is one engine's)."""

  failure: str | None

  @property
  def alive(self) -> bool: ...
  def start(self) -> None: ...
  def stop(self) -> None: ...
  def health(self) -> tuple[str, dict[str, Any]]: ...
  async def submit_all(self, submissions: Sequence[Submission]
                       ) -> tuple[Admission, list[Stream] | None]: ...
  def abort(self, request_id: str, reason: str = "aborted") -> None: ...
  async def status(self, request_id: str) -> QueueStatus | None: ...
  async def wait_idle(self, timeout_s: float) -> bool: ...
  async def abort_all(self) -> int: ...


class Backend(Protocol):
  """What the gateway serves from: one engine on a thread of this process
  (`EngineBackend`), or a fleet of them (`kvpage.serve.ray_fleet.FleetBackend`)."""

  computes_logits: bool

  def arrival_time(self) -> float | None:
    """Now on the engine's clock (a request's arrival), or None: the engine stamps it."""
  def open(self, loop: asyncio.AbstractEventLoop, tokenizer: Any) -> Loop:
    """The engine side's asyncio face, on `loop`."""
  def rejected(self, status: int) -> None:
    """A request was answered with an error status before its response started."""
  async def render_metrics(self) -> bytes:
    """`/metrics`, in Prometheus text."""


class EngineBackend:
  """One engine, stepped by a thread of this process (`EngineLoop`)."""

  def __init__(self, engine: Engine, model_name: str):
    self.engine = engine
    self.metrics = ServerMetrics(engine.scheduler, engine.clock, model_name)
    self.computes_logits = engine.executor.computes_logits

  def arrival_time(self) -> float:
    return self.engine.clock()

  def open(self, loop: asyncio.AbstractEventLoop, tokenizer: Any) -> EngineLoop:
    return EngineLoop(self.engine, loop, metrics=self.metrics, tokenizer=tokenizer)

  def rejected(self, status: int) -> None:
    self.metrics.rejected(status)

  async def render_metrics(self) -> bytes:
    return self.metrics.render()


class Gateway:
  """The server's state: the engine side, the tokenizer, and whether it is draining."""

  def __init__(self, engine: Engine | Backend, config: ServerConfig, tokenizer: Any = None):
    self.backend: Backend = (EngineBackend(engine, config.model_name)
                             if isinstance(engine, Engine) else engine)
    self.config = config
    self.tokenizer = tokenizer
    self.loop: Loop | None = None
    self.created = int(time.time())
    self.draining = False
    self._drain_ends = 0.0
    # The pre-check: the most characters a prompt that fits the context can have (for
    # token ids, the most ids), and the body that can carry it.
    self.chars_per_token = longest_token_chars(tokenizer) if tokenizer is not None else 1
    self.max_prompt_chars = config.max_model_len * self.chars_per_token
    self.body_limit = min(MAX_BODY_BYTES,
                          BODY_SLACK_BYTES + BODY_BYTES_PER_CHAR * self.max_prompt_chars)
    self._tokenize_pool: concurrent.futures.ThreadPoolExecutor | None = None

  # Lifecycle.
  def start(self) -> None:
    """Starts the engine thread; call from the event loop that serves."""
    self.loop = self.backend.open(asyncio.get_running_loop(), self.tokenizer)
    self.loop.start()
    if self.tokenizer is not None:
      self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(
          TOKENIZER_THREADS, thread_name_prefix="kvpage-tokenize")

  def stop(self) -> None:
    if self.loop is not None:
      self.loop.stop()
    if self._tokenize_pool is not None:
      self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

  async def drain(self) -> int:
    """Stops admitting; lets live requests finish for up to `drain_timeout_s`, then
    aborts the rest; returns how many were aborted."""
    self.draining = True
    self._drain_ends = time.monotonic() + self.config.drain_timeout_s
    assert self.loop is not None
    if await self.loop.wait_idle(self.config.drain_timeout_s):
      return 0
    return await self.loop.abort_all()

  # Requests.
  async def generate(self, gen: GenerationRequest, http: fastapi.Request) -> responses.Response:
    """Checks, tokenizes and submits one request; answers it streamed or whole."""
    # Arrival is now, on the engine's clock: the wait for the engine thread (a step in
    # progress) and the tokenizing count toward the request's wait and its TTFT.
    arrived = self.backend.arrival_time()
    self._check_model(gen.model)
    if gen.logprobs is not None and not self.backend.computes_logits:
      raise ApiError(400, "this server simulates its steps and computes no logits, so it has "
                     "no log-probabilities to return", code="unsupported_option",
                     param="logprobs")
    if self.draining:  # going away: a retry here would find it gone (x-should-retry: false)
      remaining = max(self._drain_ends - time.monotonic(), 1.0)
      raise ApiError(SERVICE_UNAVAILABLE, "the server is draining: it admits no new requests",
                     "service_unavailable_error", "draining",
                     headers=push_back_headers(remaining, "draining", retry=False))
    if self.loop is None or not self.loop.alive:
      raise ApiError(500, f"the engine stopped: {self.loop and self.loop.failure}",
                     "server_error", "engine_dead")
    created = int(time.time())  # the response's `created`: when the request came
    prompt_ids = await self._prompt_ids(gen)
    if ((gen.max_tokens is None or _scoring_only(gen))
        and len(prompt_ids) >= self.config.max_model_len):
      # (named in what the client sent: no max_tokens of ours in the message)
      raise ApiError(400, f"the prompt's {len(prompt_ids):,} tokens leave no room for output "
                     f"in the model's context of {self.config.max_model_len:,} tokens",
                     code="context_length_exceeded",
                     param="messages" if gen.chat else "prompt")
    # Echo with max_tokens 0 scores the prompt only: one token is sampled (its step
    # computes the prompt's logits) and dropped.
    max_tokens = 1 if _scoring_only(gen) else gen.max_tokens or (
        max(1, self.config.max_model_len - len(prompt_ids)) if gen.chat
        else DEFAULT_COMPLETION_TOKENS)
    if gen.min_tokens > max_tokens:  # (only a default max_tokens can fall short here)
      raise protocol.invalid("min_tokens", f"'min_tokens' ({gen.min_tokens}) exceeds the "
                             f"{max_tokens} tokens the context leaves after the prompt")
    # The client's stop tokens end the request even with ignore_eos (vLLM's meaning).
    eos = () if gen.ignore_eos else self.config.eos_token_ids
    sampling = SamplingParams(
        max_tokens=max_tokens, temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p,
        seed=gen.seed, stop_token_ids=tuple(dict.fromkeys((*gen.stop_token_ids, *eos))),
        min_tokens=gen.min_tokens, logprobs=gen.logprobs,
        prompt_logprobs=gen.logprobs if gen.echo else None)
    request_id = self._request_id(gen, http)
    # n > 1: a request per choice, admitted together or not at all; each after the first
    # reads the prompt's pages the first computed (prefix caching), and draws from its
    # own seed (the given one + its index).
    ids = [request_id] if gen.n == 1 else [f"{request_id}-{i}" for i in range(gen.n)]
    submissions = [Submission(
        child, prompt_ids, sampling if gen.seed is None or i == 0 else dataclasses.replace(
            sampling, seed=(gen.seed + i) % protocol.SEED_LIMIT),
        gen.priority, self._deadline(gen, http), gen.stop, arrived,
        include_stop_str=gen.include_stop_str_in_output,
        skip_special_tokens=gen.skip_special_tokens,
        own_stop_token_ids=tuple(i for i in gen.stop_token_ids if i not in eos),
        parent_id=ids[0] if i else None,
        status_at_admission=gen.stream and gen.include_status) for i, child in enumerate(ids)]
    try:
      answer, streams = await self.loop.submit_all(submissions)
    except EngineStoppedError as error:
      raise ApiError(500, f"the engine stopped: {error}", "server_error", "engine_dead") from None
    if streams is None:
      raise self._refusal(answer)
    for stream in streams:
      stream.created = created
      stream.response_id = request_id
    if gen.stream:
      return responses.StreamingResponse(
          self._events(gen, streams), media_type="text/event-stream",
          headers={**SSE_HEADERS, "x-request-id": request_id})
    return await self._whole(gen, streams, http)

  def _check_model(self, model: str | None) -> None:
    if model is not None and model != self.config.model_name:
      raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                     f"{self.config.model_name!r}", "not_found_error", "model_not_found",
                     "model")

  async def _prompt_ids(self, gen: GenerationRequest) -> list[int]:
    """The prompt's token ids; text is tokenized on the tokenizer's threads."""
    if gen.prompt_ids is not None:
      return gen.prompt_ids
    if self.tokenizer is None:
      what = "chat messages" if gen.chat else "a text prompt"
      raise ApiError(400, f"this server has no tokenizer (random weights from a config), so "
                     f"it cannot read {what}; send 'prompt' as a list of token ids",
                     code="no_tokenizer", param="messages" if gen.chat else "prompt")
    self._check_text_fits(gen)
    assert self._tokenize_pool is not None
    return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool,
                                                            self._tokenize, gen)

  def _check_text_fits(self, gen: GenerationRequest) -> None:
    """Refuses, before any tokenizer runs, text that cannot fit the context: more
    characters than `max_prompt_chars`, or more chat messages than tokens."""
    limit = self.config.max_model_len
    param = "messages" if gen.chat else "prompt"
    if gen.chat and len(gen.messages or ()) > limit:
      raise ApiError(400, f"{len(gen.messages or ()):,} messages cannot fit the model's "
                     f"context of {limit:,} tokens", code="context_length_exceeded",
                     param=param)
    chars = (sum(len(m["content"]) for m in gen.messages or ()) if gen.chat
             else len(gen.prompt_text or ""))
    if chars > self.max_prompt_chars:
      raise ApiError(400, f"the prompt's {chars:,} characters cannot fit the model's context "
                     f"of {limit:,} tokens (a token of this tokenizer holds at most "
                     f"{self.chars_per_token} characters)", code="context_length_exceeded",
                     param=param)

  def _tokenize(self, gen: GenerationRequest) -> list[int]:
    """The prompt's token ids (on a tokenizer thread)."""
    if gen.chat:
      try:
        text = self.tokenizer.apply_chat_template(gen.messages, add_generation_prompt=True,
                                                  tokenize=False)
      except Exception as error:  # the template's own checks (roles, order) raise
        raise ApiError(400, f"the chat template refused the messages: {error}",
                       code="invalid_messages", param="messages") from None
      return list(self.tokenizer.encode(text, add_special_tokens=False))
    return list(self.tokenizer.encode(gen.prompt_text))

  @staticmethod
  def _request_id(gen: GenerationRequest, http: fastapi.Request) -> str:
    """The client's `x-request-id` (a retry that repeats it keeps its place in line
    when reservations are on), else a fresh one."""
    given = http.headers.get("x-request-id")
    if given is not None:
      if not 0 < len(given) <= MAX_REQUEST_ID or not given.isprintable():
        raise protocol.invalid("x-request-id", f"the x-request-id header must be 1 to "
                               f"{MAX_REQUEST_ID} printable characters")
      return given
    return f"{'chatcmpl' if gen.chat else 'cmpl'}-{uuid.uuid4().hex}"

  def _deadline(self, gen: GenerationRequest, http: fastapi.Request) -> float | None:
    if gen.max_queue_wait_s is not None:
      return gen.max_queue_wait_s
    header = http.headers.get("x-kvpage-max-wait-s")
    if header is None:
      return self.config.max_queue_wait_s
    try:
      value = float(header)
    except ValueError:
      value = math.nan
    if not 0 < value < math.inf:
      raise protocol.invalid("x-kvpage-max-wait-s", f"the x-kvpage-max-wait-s header must be "
                             f"a number of seconds > 0, got {header!r}")
    return value

  def _refusal(self, answer: Admission) -> ApiError:
    """The scheduler's no, as an HTTP error with its push-back headers."""
    if answer.status == 400:
      param = "prompt" if answer.cause in ("empty_prompt", "invalid_token_ids") else None
      return ApiError(400, answer.reason, code=answer.cause, param=param)
    status = self.config.kv_pressure_status if answer.cause == "kv_pressure" else answer.status
    error_type = "service_unavailable_error" if status == 503 else "rate_limit_error"
    return ApiError(status, answer.reason, error_type, answer.cause,
                    headers=push_back_headers(answer.retry_after, answer.cause,
                                              request_id=answer.request_id))

  # Answers.
  def _chunk(self, gen: GenerationRequest, stream: Stream, text: str | None,
             token_ids: tuple[int, ...], finish_reason: str | None,
             last: Delta | None = None, index: int = 0) -> dict[str, Any]:
    """One streamed chunk of choice `index`; `last`, the delta it carries (its count of
    output tokens for continuous usage, and on the final chunk why it stopped)."""
    choice: dict[str, Any] = {"index": index}
    if gen.chat:
      choice["delta"] = {} if text is None else {"content": text}
    else:
      choice["text"] = text or ""
    choice["logprobs"] = (self._logprobs(gen, last.logprobs) if last and last.logprobs
                          and not finish_reason else None)
    choice["finish_reason"] = finish_reason
    choice["stop_reason"] = last.stop_reason if finish_reason and last else None
    if gen.return_token_ids or self.tokenizer is None:
      choice["token_ids"] = list(token_ids)
    chunk = {"id": stream.response_id,
             "object": "chat.completion.chunk" if gen.chat else "text_completion",
             "created": stream.created, "model": self.config.model_name, "choices": [choice]}
    if gen.include_usage:  # OpenAI: null on every chunk but the last; vLLM: so far
      chunk["usage"] = (self._usage(stream, last.num_output_tokens if last else 0)
                        if gen.continuous_usage else None)
    return chunk

  def _token_text(self, token_id: int) -> str:
    """A token as the log-probabilities name it: its text alone (vLLM's choice), or
    `token_id:N` on a server without a tokenizer."""
    if self.tokenizer is None:
      return f"token_id:{token_id}"
    return self.tokenizer.decode([token_id], skip_special_tokens=False)

  def _logprobs(self, gen: GenerationRequest, entries: Sequence[TokenLogprobs],
                prompt: Sequence[int] = (),
                prompt_entries: Sequence[TokenLogprobs | None] = ()) -> dict[str, Any]:
    """`entries` in OpenAI's shape: chat's `content` list, or completions' four lists
    (the top dicts hold the sampled token too, as vLLM's do), after the `prompt` tokens'
    (echo: null for the first, which nothing scores)."""
    if gen.chat:
      def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = self._token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

      return {"content": [item(e.token_id, e.logprob) | {
          "top_logprobs": [item(i, v) for i, v in e.top]} for e in entries]}
    scored: list[TokenLogprobs | None] = [*(prompt_entries or [None] * len(prompt)), *entries]
    ids = [*prompt, *(e.token_id for e in entries)]
    tokens = [self._token_text(token_id) for token_id in ids]
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))
    return {"tokens": tokens,
            "token_logprobs": [None if e is None else e.logprob for e in scored],
            "top_logprobs": [None if e is None else {
                self._token_text(i): v for i, v in (*e.top, (e.token_id, e.logprob))}
                for e in scored],
            "text_offset": offsets}

  def _echo(self, gen: GenerationRequest, stream: Stream) -> str:
    """The prompt as the answer repeats it (echo): its text, else its ids decoded."""
    if gen.prompt_text is not None:
      return gen.prompt_text
    if self.tokenizer is None:
      return ""
    return self.tokenizer.decode(stream.prompt_ids, skip_special_tokens=False)

  def _usage(self, stream: Stream, num_output_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": stream.num_prompt_tokens,
            "completion_tokens": num_output_tokens,
            "total_tokens": stream.num_prompt_tokens + num_output_tokens}

  def _status_chunk(self, gen: GenerationRequest, stream: Stream,
                    status: QueueStatus) -> dict[str, Any]:
    return {"id": stream.response_id,
            "object": "chat.completion.chunk" if gen.chat else "text_completion",
            "created": stream.created, "model": self.config.model_name, "choices": [],
            "status": {"state": status.state, "position": status.position,
                       "waited_s": round(status.waited_s, 3), "eta_s": round(status.eta_s, 3)}}

  def _ended_error(self, last: Delta, request_id: str | None = None) -> ApiError:
    if last.finish_reason == "deadline":
      return ApiError(429, "the request's max_queue_wait_s passed before it was scheduled",
                      "rate_limit_error", "wait_deadline",
                      headers=push_back_headers(last.retry_after, "wait_deadline",
                                                request_id=request_id))
    if last.error is not None and last.error.startswith(REPLICA_LOST):  # a fleet's replica
      return ApiError(SERVICE_UNAVAILABLE, last.error, "service_unavailable_error",
                      "replica_lost", headers=push_back_headers(1.0, "replica_lost"))
    return ApiError(500, last.error or f"the engine stopped: {self.loop and self.loop.failure}",
                    "server_error", "engine_dead")

  async def _events(self, gen: GenerationRequest,
                    streams: list[Stream]) -> AsyncIterator[bytes]:
    """The SSE stream of an admitted request (n > 1: its choices interleaved as their
    tokens come, each chunk with its `index`), then usage if asked and `[DONE]`; aborts
    what is still live if the client goes away."""
    ends: list[Delta | None] = [None] * len(streams)
    try:
      if len(streams) == 1:
        async for event in self._choice_events(gen, streams[0], 0, ends):
          yield event
      else:
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()

        async def pump(index: int, stream: Stream) -> None:
          try:
            async for event in self._choice_events(gen, stream, index, ends):
              await queue.put(event)
          finally:
            queue.put_nowait(None)

        tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
        try:
          running = len(tasks)
          while running:
            event = await queue.get()
            if event is None:
              running -= 1
            else:
              yield event
        finally:
          for task in tasks:
            task.cancel()
      failed = any(end is not None and end.finish_reason in ("deadline", "error")
                   for end in ends)
      if gen.include_usage and not failed:
        total = sum(end.num_output_tokens for end in ends if end is not None)
        yield _sse(self._chunk(gen, streams[0], None, (), None) | {
            "choices": [], "usage": self._usage(streams[0], total)})
      yield b"data: [DONE]\n\n"
    finally:
      for stream, end in zip(streams, ends, strict=True):
        if end is None:  # the client went away (or the server is shutting down)
          self.loop.abort(stream.request_id)

  async def _choice_events(self, gen: GenerationRequest, stream: Stream, index: int,
                           ends: list[Delta | None]) -> AsyncIterator[bytes]:
    """One choice's events, until its last delta (then in `ends[index]`)."""
    assert self.loop is not None
    echoed, state, told_waiting = False, "queueing", False
    if gen.chat:
      first = self._chunk(gen, stream, "", (), None, index=index)
      first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
      yield _sse(first)
    admitted = stream.admitted
    if (gen.include_status and admitted is not None and admitted.state != "running"
        and not stream.has_pending):  # it waits: told so at once, with its ETA
      told_waiting = True
      yield _sse(self._status_chunk(gen, stream, admitted))
    while True:
      # While waiting, a status line whenever nothing came for an interval.
      delta = await stream.next(None if state == "running" else self.config.status_interval_s)
      if delta is None:
        status = await self.loop.status(stream.request_id)
        if status is not None and status.state != "running":
          told_waiting = True
          yield (_sse(self._status_chunk(gen, stream, status)) if gen.include_status
                 else _comment(status))
        continue
      if delta.preempted:
        state = "preempted"
        continue
      if told_waiting and gen.include_status and delta.finish_reason is None:
        # The stream said it waits; now it says it runs (once per wait).
        yield _sse(self._status_chunk(gen, stream, QueueStatus("running", 0, 0.0, 0.0)))
      state, told_waiting = "running", False
      if delta.finish_reason in ("deadline", "error"):
        ends[index] = delta
        yield _sse(self._ended_error(delta).body())
        return
      if gen.echo and not echoed:  # the prompt first, with its log-probabilities
        echoed = True
        chunk = self._chunk(gen, stream, self._echo(gen, stream), (), None, index=index)
        if gen.logprobs is not None:
          chunk["choices"][0]["logprobs"] = self._logprobs(
              gen, (), stream.prompt_ids, delta.prompt_logprobs or ())
        yield _sse(chunk)
      scoring = _scoring_only(gen)
      if not scoring and (delta.text or (delta.token_ids and self._shows_tokens(gen))):
        yield _sse(self._chunk(gen, stream, delta.text, delta.token_ids, None, delta, index))
      if delta.finish_reason is not None:
        if scoring:  # (the one token sampled to score the prompt is not the answer)
          delta = dataclasses.replace(delta, finish_reason="length", stop_reason=None,
                                      num_output_tokens=0, logprobs=())
        ends[index] = delta
        yield _sse(self._chunk(gen, stream, None, (), delta.finish_reason, delta, index))
        return

  def _shows_tokens(self, gen: GenerationRequest) -> bool:
    return gen.return_token_ids or self.tokenizer is None

  async def _whole(self, gen: GenerationRequest, streams: list[Stream],
                   http: fastapi.Request) -> responses.Response:
    """A request answered in one body once every choice ends; aborted if the client
    goes away."""
    assert self.loop is not None
    gone = asyncio.ensure_future(_disconnected(http))
    done = asyncio.ensure_future(asyncio.wait({stream.done for stream in streams}))
    try:
      await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
      gone.cancel()
      done.cancel()
    if not all(stream.done.done() for stream in streams):
      for stream in streams:
        self.loop.abort(stream.request_id)
      return responses.Response(status_code=499)  # nobody is listening any more
    choices, total = [], 0
    for index, stream in enumerate(streams):
      deltas = stream.delivered()
      last = stream.done.result()
      if last.finish_reason in ("deadline", "error"):
        raise self._ended_error(last, stream.request_id)
      choice, last = self._whole_choice(gen, stream, deltas, last, index)
      choices.append(choice)
      total += last.num_output_tokens
    first = streams[0]
    return responses.JSONResponse({
        "id": first.response_id, "object": "chat.completion" if gen.chat else "text_completion",
        "created": first.created, "model": self.config.model_name, "choices": choices,
        "usage": self._usage(first, total)})

  def _whole_choice(self, gen: GenerationRequest, stream: Stream, deltas: list[Delta],
                    last: Delta, index: int) -> tuple[dict[str, Any], Delta]:
    """One choice of a whole answer, and its last delta (as counted in usage)."""
    prompt_scored = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs), ())
    if _scoring_only(gen):  # the token sampled to score the prompt is not the answer
      deltas, last = [], dataclasses.replace(last, finish_reason="length", stop_reason=None,
                                             num_output_tokens=0)
    text = "".join(delta.text for delta in deltas)
    token_ids = [token for delta in deltas for token in delta.token_ids]
    scored = tuple(entry for delta in deltas for entry in delta.logprobs)
    choice: dict[str, Any] = {"index": index}
    if gen.chat:
      choice["message"] = {"role": "assistant", "content": text}
    else:
      choice["text"] = (self._echo(gen, stream) if gen.echo else "") + text
    prompt = stream.prompt_ids if gen.echo else ()
    choice |= {"logprobs": self._logprobs(gen, scored, prompt, prompt_scored)
                           if gen.logprobs is not None else None,
               "finish_reason": last.finish_reason, "stop_reason": last.stop_reason}
    if self._shows_tokens(gen):
      choice["token_ids"] = token_ids
    return choice, last


def _scoring_only(gen: GenerationRequest) -> bool:
  """Echo with `max_tokens` 0: the prompt scored, nothing generated."""
  return gen.echo and gen.max_tokens == 0


def _sse(payload: dict[str, Any]) -> bytes:
  return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _comment(status: QueueStatus) -> bytes:
  return (f": {status.state} position={status.position} waited_s={status.waited_s:.1f} "
          f"eta_s={status.eta_s:.1f}\n\n").encode()


async def _disconnected(http: fastapi.Request) -> None:
  """Returns when the client disconnects (the body was read already)."""
  while (await http.receive())["type"] != "http.disconnect":
    pass


class ClientGoneError(Exception):
  """The client went away before its request's body arrived: nobody to answer."""


def _is_json(content_type: str) -> bool:
  media_type = content_type.split(";")[0].strip().lower()
  return media_type == "application/json" or (media_type.startswith("application/")
                                               and media_type.endswith("+json"))


async def _json_body(http: fastapi.Request, limit: int, timeout_s: float) -> Any:
  """The request's JSON body: declared as JSON (415), at most `limit` bytes (413), read
  within `timeout_s` (408, and the connection closes), and valid (400)."""
  content_type = http.headers.get("content-type", "")
  if not _is_json(content_type):
    # Also what keeps a web page out: a browser posts text/plain cross-origin unasked.
    raise ApiError(415, f"the request body must be JSON (Content-Type: application/json), "
                   f"got {content_type or 'no Content-Type'!r}", code="unsupported_media_type")
  declared = http.headers.get("content-length", "0")
  if declared.isdigit() and int(declared) > limit:
    raise ApiError(413, f"the request body ({int(declared):,} bytes) exceeds {limit:,} bytes, "
                   "the most a prompt that fits the model's context needs",
                   code="body_too_large")
  raw = bytearray()
  try:
    async with asyncio.timeout(timeout_s):
      async for part in http.stream():  # bounded even when no length was declared
        raw += part
        if len(raw) > limit:
          raise ApiError(413, f"the request body exceeds {limit:,} bytes, the most a prompt "
                         "that fits the model's context needs", code="body_too_large")
  except TimeoutError:
    raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s",
                   code="body_timeout", headers={"Connection": "close"}) from None
  except ClientDisconnect:
    raise ClientGoneError() from None
  try:
    return json.loads(bytes(raw))
  except (json.JSONDecodeError, UnicodeDecodeError) as error:
    raise ApiError(400, f"the request body is not valid JSON: {error}",
                   code="invalid_json") from None
  except RecursionError:
    raise ApiError(400, "the request body nests JSON arrays or objects too deeply",
                   code="invalid_json") from None
  except ValueError:  # an integer of more digits than Python converts (4,300)
    raise ApiError(400, "the request body holds a number of too many digits to read",
                   code="invalid_json") from None


class Door:
  """ASGI middleware: who may come in. The `Host` header must name an allowed host
  (400 otherwise: a DNS-rebinding page names its own), and with API keys set, a
  guarded path needs `Authorization: Bearer KEY` (401, in OpenAI's error shape)."""

  def __init__(self, app: Callable[..., Awaitable[None]], config: ServerConfig):
    self.app = app
    self.keys = [key.encode() for key in config.api_keys]
    self.open_probes = config.open_probes
    self.hosts = None if "*" in config.allowed_hosts else {
        host.lower().strip("[]") for host in config.allowed_hosts}

  async def __call__(self, scope: dict, receive: Callable[..., Awaitable[Any]],
                     send: Callable[..., Awaitable[None]]) -> None:
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    headers = dict(scope["headers"])
    if self.hosts is not None and _host_name(headers.get(b"host", b"")) not in self.hosts:
      error = ApiError(400, "the Host header names a host this server does not serve "
                       "(server.allowed_hosts)", code="invalid_host")
      return await _send_error(send, error)
    guarded = scope["path"].startswith("/v1/") or not self.open_probes
    if self.keys and guarded and scope["method"] != "OPTIONS" and not self._authorized(
        headers.get(b"authorization", b"")):
      error = ApiError(401, "a valid API key is needed: send 'Authorization: Bearer KEY'",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
      return await _send_error(send, error)
    return await self.app(scope, receive, send)

  def _authorized(self, header: bytes) -> bool:
    scheme, _, token = header.partition(b" ")
    token = token.strip()
    # Every key compared, each in constant time: no early exit says how much matched.
    matches = [hmac.compare_digest(token, key) for key in self.keys]
    return scheme.lower() == b"bearer" and any(matches)


def _host_name(host: bytes) -> str:
  """The name in a Host header, without its port: `[::1]:8000` -> `::1`."""
  text = host.decode("latin-1").lower()
  if text.startswith("["):
    return text[1:text.find("]")] if "]" in text else text
  return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


async def _send_error(send: Callable[..., Awaitable[None]], error: ApiError) -> None:
  response = responses.JSONResponse(error.body(), error.status, headers=error.headers)
  await send({"type": "http.response.start", "status": response.status_code,
              "headers": response.raw_headers})
  await send({"type": "http.response.body", "body": response.body})


def make_app(gateway: Gateway) -> fastapi.FastAPI:
  """The FastAPI application serving `gateway`; its lifespan runs the engine thread."""

  @contextlib.asynccontextmanager
  async def lifespan(app: fastapi.FastAPI) -> AsyncIterator[None]:
    del app
    gateway.start()
    try:
      yield
    finally:
      gateway.stop()

  app = fastapi.FastAPI(title="kvpage", lifespan=lifespan, docs_url=None, redoc_url=None,
                        openapi_url=None)
  if gateway.config.allowed_origins:
    app.add_middleware(
        CORSMiddleware, allow_origins=list(gateway.config.allowed_origins),
        allow_methods=["GET", "POST"], allow_headers=[
            "Authorization", "Content-Type", "x-request-id", "x-kvpage-max-wait-s"],
        expose_headers=["Retry-After", "retry-after-ms", "x-should-retry",
                        "x-kvpage-reject-reason", "x-request-id"], max_age=600)
  app.add_middleware(Door, config=gateway.config)  # outermost: checked first

  @app.exception_handler(ApiError)
  async def api_error(request: fastapi.Request, error: ApiError) -> responses.JSONResponse:
    del request
    gateway.backend.rejected(error.status)
    return responses.JSONResponse(error.body(), error.status, headers=error.headers)

  @app.exception_handler(ClientGoneError)
  async def client_gone(request: fastapi.Request, error: ClientGoneError) -> responses.Response:
    del request, error
    return responses.Response(status_code=499)  # nobody is listening any more

  @app.exception_handler(StarletteHTTPException)
  async def http_error(request: fastapi.Request,
                       error: StarletteHTTPException) -> responses.JSONResponse:
    del request
    error_type = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    return responses.JSONResponse(protocol.error_body(str(error.detail), error_type),
                                  error.status_code, headers=error.headers)

  @app.exception_handler(Exception)
  async def internal_error(request: fastapi.Request, error: Exception) -> responses.JSONResponse:
    del request
    return responses.JSONResponse(protocol.error_body(
        f"internal error ({type(error).__name__}: {error}); this is a kvpage defect",
        "server_error"), 500)

  @app.post("/v1/completions")
  async def completions(http: fastapi.Request) -> responses.Response:
    body = await _json_body(http, gateway.body_limit, gateway.config.body_timeout_s)
    return await gateway.generate(protocol.parse_completion(body), http)

  @app.post("/v1/chat/completions")
  async def chat_completions(http: fastapi.Request) -> responses.Response:
    body = await _json_body(http, gateway.body_limit, gateway.config.body_timeout_s)
    return await gateway.generate(protocol.parse_chat(body), http)

  @app.get("/v1/models")
  async def models() -> dict[str, Any]:
    return {"object": "list", "data": [{
        "id": gateway.config.model_name, "object": "model", "created": gateway.created,
        "owned_by": "kvpage", "max_model_len": gateway.config.max_model_len,
        **({"kvpage_backends": gateway.config.backends} if gateway.config.backends else {})}]}

  @app.get("/health")
  async def health() -> responses.JSONResponse:
    if gateway.loop is None:
      return responses.JSONResponse({"status": "error", "detail": "not started"}, 503)
    status, detail = gateway.loop.health()
    if status == "error":
      return responses.JSONResponse({"status": status, **detail}, 503)
    if gateway.draining:
      return responses.JSONResponse({"status": "draining", **detail}, 503)
    # "degraded": a fleet serving with fewer replicas than it should (still 200: it serves)
    return responses.JSONResponse({"status": status, **detail})

  @app.get("/metrics")
  async def metrics() -> responses.Response:
    return responses.Response(await gateway.backend.render_metrics(),
                              media_type=prometheus_client.CONTENT_TYPE_LATEST)

  return app
