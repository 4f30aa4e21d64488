"""The flag-free core of `benchmarks/serve_http.py`: a bounded, streaming load client
for any OpenAI-compatible server, its per-request records and its summary.

`run_load(LoadConfig(...))` runs the load and `summarize` reduces it; the module
docstring of `benchmarks/serve_http.py` says what is measured and how. Kept apart from
the command line so that tests and other benchmarks import it without defining flags.
"""


import asyncio
import collections
import dataclasses
import datetime
import email.utils
import json
import math
import platform
import random
import socket
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import aiohttp
import numpy as np

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
RETRYABLE_STATUSES = (429, 503)
MAX_WAIT_S = 120.0  # the longest wait before a retry; a longer hint means give up
BACKOFF_S = 0.5  # the first wait without a hint, doubled at each retry
_WORDS = (  # chat prompts: common words, about one token each
    "time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world",
    "school", "state", "family", "student", "group", "country", "problem", "hand", "part",
    "place", "case", "week", "company", "system", "program", "question", "work", "number",
    "night", "point", "home", "water", "room", "mother", "area", "money", "story", "fact",
    "month", "lot", "right", "study", "book", "eye", "job", "word", "business", "issue", "side",
    "kind", "head", "house", "service", "friend", "father", "power", "hour", "game", "line",
    "end", "member", "law", "car", "city", "name",
)

Clock = Callable[[], float]


@dataclasses.dataclass(frozen=True)
class LoadConfig:
  """One load run. Every field is also a flag of the same name (see the module doc)."""

  url: str = "http://127.0.0.1:8000"
  model: str | None = None  # None: the first id of GET /v1/models
  endpoint: str = "completions"  # completions | chat
  num_requests: int = 64
  request_rate: float = math.inf  # requests/s; inf = all at once
  max_concurrency: int = 0  # requests in progress at most; 0 = no cap
  prompt_len: int = 128  # tokens (completions) or words (chat)
  output_len: int = 128  # max_tokens
  min_token_id: int = 10
  max_token_id: int = 500  # exclusive
  ignore_eos: bool = True
  temperature: float = 0.0  # greedy: every engine computes the same work
  seed: int = 0
  max_retries: int = 3
  honor_retry_after: bool = True
  include_status: bool = False  # ask for status chunks while waiting (kvpage's option)
  max_queue_wait_s: float | None = None  # kvpage's wait deadline, sent in every body
  timeout_s: float = 600.0  # wall bound of the whole load

  def __post_init__(self) -> None:
    check_loopback(self.url)
    if self.endpoint not in ENDPOINTS:
      raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {self.endpoint!r}")
    for name, least in (("num_requests", 1), ("prompt_len", 1), ("output_len", 1),
                        ("max_concurrency", 0), ("max_retries", 0), ("min_token_id", 0)):
      if getattr(self, name) < least:
        raise ValueError(f"{name} must be at least {least}, got {getattr(self, name)}")
    if self.max_token_id <= self.min_token_id:
      raise ValueError(f"max_token_id ({self.max_token_id}) must exceed min_token_id "
                       f"({self.min_token_id})")
    if not self.request_rate > 0:
      raise ValueError(f"request_rate must be positive (inf = all at once), "
                       f"got {self.request_rate}")
    if not 0 <= self.temperature < math.inf:
      raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
    if not 0 < self.timeout_s < math.inf:
      raise ValueError(f"timeout_s must be positive and finite, got {self.timeout_s}")
    if self.max_queue_wait_s is not None and not 0 < self.max_queue_wait_s < math.inf:
      raise ValueError(f"max_queue_wait_s must be positive and finite (or unset), got "
                       f"{self.max_queue_wait_s}")

  @property
  def base_url(self) -> str:
    """`url` without a trailing `/` or `/v1`: the paths sent all start with `/v1/`."""
    return self.url.rstrip("/").removesuffix("/v1")


def check_loopback(url: str) -> None:
  """Refuses any URL whose host is not this machine: this is a load generator."""
  parts = urllib.parse.urlsplit(url)
  try:
    parts.port  # noqa: B018  (parsing it is the check)
  except ValueError:
    raise ValueError(f"url {url!r} has an invalid port") from None
  if parts.scheme not in ("http", "https") or not parts.hostname:
    raise ValueError(f"url {url!r} is not an http:// or https:// URL with a host")
  if parts.hostname not in LOOPBACK_HOSTS:
    raise ValueError(f"url {url!r} targets {parts.hostname!r}: serve_http is a load "
                     f"generator and only targets loopback hosts ({', '.join(LOOPBACK_HOSTS)})")


@dataclasses.dataclass
class Attempt:
  """One HTTP request of a logical request; times in seconds since the run started."""

  send_s: float
  wait_s: float = 0.0  # slept before this attempt (0 for the first)
  honoured_hint: bool = False  # that wait was the server's hint
  status: int | None = None  # HTTP status; None if no answer came
  hint_s: float | None = None  # the retry hint a rejection carried, None if none
  reason: str | None = None  # a rejection's `x-kvpage-reject-reason`, None if unstated


@dataclasses.dataclass
class RequestRecord:
  """What happened to one request, attempts included; times in seconds since the start."""

  index: int
  scheduled_s: float  # when it was due to arrive
  attempts: list[Attempt] = dataclasses.field(default_factory=list)
  outcome: str = "unfinished"  # served | failed | unfinished (cancelled at timeout_s)
  failure: str | None = None  # what kind: rejected, not_retried, http_error, transport,
  error: str | None = None  #    stream_error or bad_stream; and the detail
  chunk_times_s: list[float] = dataclasses.field(default_factory=list)  # content chunks
  usage_tokens: int | None = None  # usage.completion_tokens, if the server sent it
  finish_reason: str | None = None
  status_comments: int = 0  # SSE comment lines
  status_chunks: int = 0  # data chunks with no choices and a "status" key
  # Each status chunk's (arrival, state, eta_s) (with `include_status`).
  statuses: list[tuple[float, str, float | None]] = dataclasses.field(default_factory=list)
  stream_errors: list[Any] = dataclasses.field(default_factory=list)

  def fail(self, failure: str, error: str) -> None:
    self.outcome, self.failure, self.error = "failed", failure, error

  @property
  def sent(self) -> bool:
    return bool(self.attempts)

  @property
  def output_tokens(self) -> int:
    return len(self.chunk_times_s) if self.usage_tokens is None else self.usage_tokens

  @property
  def ttft_s(self) -> float | None:
    """From the send of the admitted attempt (the last one) to the first content chunk."""
    return self.chunk_times_s[0] - self.attempts[-1].send_s if self.chunk_times_s else None

  @property
  def ttft_incl_retries_s(self) -> float | None:
    """From the send of the first attempt, rejections and waits included."""
    return self.chunk_times_s[0] - self.attempts[0].send_s if self.chunk_times_s else None

  @property
  def itl_s(self) -> list[float]:
    return np.diff(self.chunk_times_s).tolist()

  @property
  def tpot_s(self) -> float | None:
    """(last chunk - first chunk) / (output tokens - 1); None with fewer than 2 chunks."""
    if len(self.chunk_times_s) < 2 or self.output_tokens < 2:
      return None
    return (self.chunk_times_s[-1] - self.chunk_times_s[0]) / (self.output_tokens - 1)

  def to_json(self) -> dict[str, Any]:
    return dict(dataclasses.asdict(self), sent=self.sent, output_tokens=self.output_tokens,
                ttft_s=self.ttft_s, ttft_incl_retries_s=self.ttft_incl_retries_s,
                tpot_s=self.tpot_s, itl_s=self.itl_s)


@dataclasses.dataclass
class LoadResult:
  """A finished run: its config, whom it talked to, and every request's record."""

  config: LoadConfig
  model: str
  server_models: Any  # the server's GET /v1/models answer; None if it had none
  started_at: str  # ISO 8601, UTC
  wall_s: float  # from the first arrival until the last answer, or timeout_s
  requests: list[RequestRecord]


# The workload: seeded, each part from its own stream, so changing the rate keeps prompts.
def arrival_times(config: LoadConfig) -> list[float]:
  """When each request is due, in seconds: all at 0 for an infinite rate, else a Poisson
  process (seeded exponential gaps) whose first arrival is at 0."""
  if math.isinf(config.request_rate):
    return [0.0] * config.num_requests
  rng = random.Random(f"arrivals:{config.seed}")
  times = [0.0]
  while len(times) < config.num_requests:
    times.append(times[-1] + rng.expovariate(config.request_rate))
  return times


def make_prompts(config: LoadConfig) -> list[list[int]] | list[str]:
  """`prompt_len` random token ids per request (completions), or as many words (chat)."""
  rng = random.Random(f"prompts:{config.seed}")
  if config.endpoint == "completions":
    return [[rng.randrange(config.min_token_id, config.max_token_id)
             for _ in range(config.prompt_len)] for _ in range(config.num_requests)]
  return [" ".join(rng.choices(_WORDS, k=config.prompt_len))
          for _ in range(config.num_requests)]


def request_body(config: LoadConfig, model: str, prompt: list[int] | str) -> dict[str, Any]:
  body: dict[str, Any] = dict(model=model, max_tokens=config.output_len, stream=True,
                              temperature=config.temperature,
                              stream_options={"include_usage": True})
  if config.endpoint == "completions":
    body["prompt"] = prompt
  else:
    body["messages"] = [{"role": "user", "content": prompt}]
  if config.ignore_eos:
    body["ignore_eos"] = True
  if config.include_status:
    body["stream_options"]["include_status"] = True
  if config.max_queue_wait_s is not None:
    body["max_queue_wait_s"] = config.max_queue_wait_s
  return body


# Retries: what the server's answer asks of a client.
def _finite_float(text: str | None) -> float | None:
  try:
    value = float(text)  # type: ignore[arg-type]
  except (TypeError, ValueError):
    return None
  return value if math.isfinite(value) else None


def retry_hint_s(headers: Mapping[str, str]) -> float | None:
  """The server's retry hint in seconds: `retry-after-ms` if present, else `Retry-After`
  (seconds or an HTTP date); None if neither is there and parses. `headers` is
  case-insensitive (as aiohttp's and httpx's are) or has lower-case keys."""
  milliseconds = _finite_float(headers.get("retry-after-ms"))
  if milliseconds is not None:
    return max(milliseconds / 1000, 0.0)
  value = headers.get("retry-after")
  seconds = _finite_float(value)
  if seconds is None and value is not None:
    try:
      when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
      return None
    if when.tzinfo is None:
      when = when.replace(tzinfo=datetime.timezone.utc)
    seconds = (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
  return None if seconds is None else max(seconds, 0.0)


@dataclasses.dataclass(frozen=True)
class RetryPlan:
  """How long to wait before retrying a rejection, or None and why not."""

  wait_s: float | None
  honoured_hint: bool = False
  reason: str = ""


def plan_retry(headers: Mapping[str, str], retries_done: int,
               honor_retry_after: bool = True) -> RetryPlan:
  """The wait before the next retry of a 429/503 answered with `headers`."""
  if headers.get("x-should-retry", "").strip().lower() == "false":
    return RetryPlan(None, reason="the server said x-should-retry: false")
  hint = retry_hint_s(headers) if honor_retry_after else None
  if hint is None:
    return RetryPlan(min(BACKOFF_S * 2**retries_done, MAX_WAIT_S))
  if hint > MAX_WAIT_S:
    return RetryPlan(None, reason=f"the server asked to wait {hint:.1f} s, more than the "
                                  f"{MAX_WAIT_S:.0f} s cap")
  return RetryPlan(hint, honoured_hint=True)


# One request: send, retry when told, read the stream.
class MalformedStreamError(Exception):
  """A stream that does not parse as OpenAI-style server-sent events."""


def _take_chunk(data: str, endpoint: str, record: RequestRecord, now: float) -> None:
  """Records one `data:` chunk that arrived at `now`."""
  try:
    chunk = json.loads(data)
  except json.JSONDecodeError:
    raise MalformedStreamError(f"undecodable data chunk {data[:100]!r}") from None
  if not isinstance(chunk, dict):
    raise MalformedStreamError(f"data chunk is not a JSON object: {data[:100]!r}")
  if "error" in chunk:
    record.stream_errors.append(chunk["error"])
    return
  if chunk.get("usage"):
    record.usage_tokens = chunk["usage"].get("completion_tokens")
  choices = chunk.get("choices") or []
  if not choices:
    if "status" in chunk:
      record.status_chunks += 1
      status = chunk["status"] if isinstance(chunk["status"], dict) else {}
      record.statuses.append((now, str(status.get("state")), _finite_float(status.get("eta_s"))))
    return
  choice = choices[0]
  text = (choice.get("text") if endpoint == "completions"
          else (choice.get("delta") or {}).get("content"))
  if text or choice.get("token_ids"):  # a server without a tokenizer sends ids only
    record.chunk_times_s.append(now)
  if choice.get("finish_reason"):
    record.finish_reason = choice["finish_reason"]


async def _lines(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
  """The body's lines as they arrive, without their line ends; no line-length limit."""
  pending = b""
  async for data in response.content.iter_any():
    pending += data
    *lines, pending = pending.split(b"\n")
    for line in lines:
      yield line.removesuffix(b"\r").decode(errors="replace")
  if pending:
    yield pending.decode(errors="replace")


async def _read_stream(response: aiohttp.ClientResponse, endpoint: str, record: RequestRecord,
                       clock: Clock) -> None:
  done = False
  async for line in _lines(response):
    now = clock()
    if line.startswith(":"):
      record.status_comments += 1
    elif line.startswith("data:"):
      data = line.removeprefix("data:").strip()
      if data == "[DONE]":
        done = True
        break
      _take_chunk(data, endpoint, record, now)
    # Blank lines end events; `event:`, `id:` and `retry:` fields carry nothing here.
  if record.stream_errors:
    record.fail("stream_error", json.dumps(record.stream_errors[0])[:200])
  elif not done:
    record.fail("bad_stream", "the stream ended before data: [DONE]")
  else:
    record.outcome = "served"


async def _send(client: aiohttp.ClientSession, config: LoadConfig, body: dict[str, Any],
                record: RequestRecord, clock: Clock) -> None:
  """Sends `body` until it is served, fails, or has been rejected `max_retries + 1` times."""
  plan, headers = RetryPlan(0.0), {}
  for retries_done in range(config.max_retries + 1):
    if retries_done:
      await asyncio.sleep(plan.wait_s)
    attempt = Attempt(send_s=clock(), wait_s=plan.wait_s, honoured_hint=plan.honoured_hint)
    record.attempts.append(attempt)
    async with client.post(config.base_url + ENDPOINTS[config.endpoint], json=body,
                           headers=headers) as response:
      attempt.status = response.status
      if response.status == 200:
        await _read_stream(response, config.endpoint, record, clock)
        return
      detail = (await response.read()).decode(errors="replace")[:200]
    if response.status not in RETRYABLE_STATUSES:
      record.fail("http_error", f"HTTP {response.status}: {detail}")
      return
    attempt.hint_s = retry_hint_s(response.headers)
    attempt.reason = response.headers.get("x-kvpage-reject-reason")
    # A retry sends back the id it was refused under: kvpage keeps its place in line.
    place = response.headers.get("x-request-id")
    headers = {"x-request-id": place} if place else {}
    plan = plan_retry(response.headers, retries_done, config.honor_retry_after)
    if plan.wait_s is None:
      record.fail("not_retried", f"HTTP {response.status}: {plan.reason}")
      return
  statuses = ", ".join(str(attempt.status) for attempt in record.attempts)
  record.fail("rejected", f"rejected on all {len(record.attempts)} attempts ({statuses})")


async def _client(client: aiohttp.ClientSession, config: LoadConfig, body: dict[str, Any],
                  record: RequestRecord, gate: asyncio.Semaphore, clock: Clock) -> None:
  """One request's life: arrive on schedule, take a concurrency slot, send."""
  await asyncio.sleep(max(0.0, record.scheduled_s - clock()))
  async with gate:
    try:
      await _send(client, config, body, record, clock)
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
      record.fail("transport", f"{type(error).__name__}: {error}")
    except MalformedStreamError as error:
      record.fail("bad_stream", str(error))


async def _list_models(client: aiohttp.ClientSession,
                       base_url: str) -> tuple[Any, str | None]:
  """The server's `GET /v1/models` answer and None, or None and why there is none."""
  try:
    async with client.get(base_url + "/v1/models",
                          timeout=aiohttp.ClientTimeout(total=10.0)) as response:
      response.raise_for_status()
      return await response.json(content_type=None), None
  except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
    return None, f"{type(error).__name__}: {error}"


def _first_model(answer: Any, why_none: str | None, base_url: str) -> str:
  try:
    return str(answer["data"][0]["id"])
  except (KeyError, IndexError, TypeError):
    problem = why_none or f"its answer lists no model id: {json.dumps(answer)[:200]}"
    raise ValueError(f"no model given, and GET {base_url}/v1/models did not name one "
                     f"({problem}); pass --model") from None


async def run_load(config: LoadConfig) -> LoadResult:
  """Runs the load `config` describes against its server; every request's record."""
  # aiohttp, as vLLM's serving benchmark: of the async clients, the one that adds the
  # least to a stream's first-token time (~2.5 ms less than httpx per request here).
  async with aiohttp.ClientSession(
      timeout=aiohttp.ClientTimeout(total=config.timeout_s),
      connector=aiohttp.TCPConnector(limit=0), trust_env=False) as client:
    server_models, why_none = await _list_models(client, config.base_url)
    model = config.model or _first_model(server_models, why_none, config.base_url)
    bodies = [request_body(config, model, prompt) for prompt in make_prompts(config)]
    records = [RequestRecord(i, t) for i, t in enumerate(arrival_times(config))]
    gate = asyncio.Semaphore(config.max_concurrency or config.num_requests)
    started_at = datetime.datetime.now(datetime.timezone.utc).isoformat()
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start
    tasks = [asyncio.create_task(_client(client, config, body, record, gate, clock))
             for body, record in zip(bodies, records, strict=True)]
    done, pending = await asyncio.wait(tasks, timeout=config.timeout_s)
    wall_s = clock()
    for task in pending:  # their records stay "unfinished"
      task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for task in done:
      task.result()  # a defect of this client surfaces, never passes for a failed request
  return LoadResult(config=config, model=model, server_models=server_models,
                    started_at=started_at, wall_s=wall_s, requests=records)


# The report.
def _distribution(values: list[float | None]) -> dict[str, float | None]:
  present = [value for value in values if value is not None]
  if not present:
    return dict(mean=None, p50=None, p99=None)
  return dict(mean=float(np.mean(present)), p50=float(np.percentile(present, 50)),
              p99=float(np.percentile(present, 99)))


def summarize(result: LoadResult) -> dict[str, Any]:
  """The run's figures: counts, rejections and retries, latencies, throughput."""
  records = result.requests
  served = [r for r in records if r.outcome == "served"]
  retries = [attempt for r in records for attempt in r.attempts[1:]]
  rejections = collections.Counter(str(attempt.status) for r in records
                                   for attempt in r.attempts
                                   if attempt.status in RETRYABLE_STATUSES)
  rejected = [r for r in records
              if any(attempt.status in RETRYABLE_STATUSES for attempt in r.attempts)]
  served_after_rejection = sum(r.outcome == "served" for r in rejected)
  wait_s = sum(attempt.wait_s for attempt in retries)
  output_tokens = sum(r.output_tokens for r in served)
  return dict(
      num_requests=len(records), sent=sum(r.sent for r in records), served=len(served),
      failed=sum(r.outcome == "failed" for r in records),
      unfinished=sum(r.outcome == "unfinished" for r in records),
      unsent=sum(not r.sent for r in records),
      failures=dict(sorted(collections.Counter(r.failure for r in records if r.failure).items())),
      rejections=dict(sorted(rejections.items())), num_rejections=sum(rejections.values()),
      retries=len(retries), retries_on_hint=sum(attempt.honoured_hint for attempt in retries),
      requests_rejected=len(rejected), served_after_rejection=served_after_rejection,
      rejected_served_fraction=served_after_rejection / len(rejected) if rejected else None,
      retry_wait_total_s=wait_s, retry_wait_mean_s=wait_s / len(retries) if retries else None,
      status_comments=sum(r.status_comments for r in records),
      status_chunks=sum(r.status_chunks for r in records),
      ttft_s=_distribution([r.ttft_s for r in served]),
      ttft_incl_retries_s=_distribution([r.ttft_incl_retries_s for r in served]),
      tpot_s=_distribution([r.tpot_s for r in served]),
      itl_s=_distribution([gap for r in served for gap in r.itl_s]),
      output_tokens=output_tokens, wall_s=result.wall_s,
      output_tokens_per_s=output_tokens / result.wall_s if result.wall_s > 0 else None,
      requests_per_s=len(served) / result.wall_s if result.wall_s > 0 else None)


def _plain(value: Any) -> Any:
  """`value` with every non-finite float as a string: JSON has no infinity."""
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)
  if isinstance(value, dict):
    return {key: _plain(item) for key, item in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(item) for item in value]
  return value


def to_record(result: LoadResult, *, label: str = "", output: str | None = None
              ) -> dict[str, Any]:
  """The JSON record: the label, the premises, the summary and every request."""
  config = result.config
  premises = dict(
      url=config.url, model=result.model, endpoint=config.endpoint,
      path=ENDPOINTS[config.endpoint], config=dataclasses.asdict(config), output=output,
      python=platform.python_version(), aiohttp=aiohttp.__version__,
      hostname=socket.gethostname(), platform=platform.platform(),
      started_at=result.started_at, server_models=result.server_models)
  return _plain(dict(label=label, premises=premises, summary=summarize(result),
                     requests=[r.to_json() for r in result.requests]))


def _ms(value: float | None) -> str:
  return "n/a" if value is None else f"{1000 * value:.1f}"


def _counts(counts: dict[str, int], before: str = "", after: str = "") -> str:
  """`{"429": 3, "503": 1}` as `429: 3, 503: 1`, between `before` and `after`; "" if empty."""
  text = ", ".join(f"{key}: {count}" for key, count in counts.items())
  return f"{before}{text}{after}" if text else ""


def format_table(result: LoadResult, summary: dict[str, Any]) -> str:
  config, s = result.config, summary
  fraction = s["rejected_served_fraction"]
  lines = [
      f"serve_http: {s['num_requests']} requests to {config.base_url}"
      f"{ENDPOINTS[config.endpoint]}, model {result.model}, rate {config.request_rate} req/s, "
      f"concurrency {config.max_concurrency or 'unbounded'}, prompt {config.prompt_len}, "
      f"output {config.output_len}",
      f"  requests    sent {s['sent']}, served {s['served']}, failed {s['failed']}"
      f"{_counts(s['failures'], ' (', ')')}, unfinished {s['unfinished']} "
      f"({s['unsent']} never sent)",
      f"  rejections  {_counts(s['rejections']) or 'none'}; {s['retries']} retries "
      f"({s['retries_on_hint']} on the server's hint), {s['retry_wait_total_s']:.2f} s slept; "
      f"{s['served_after_rejection']} of {s['requests_rejected']} rejected requests served"
      + ("" if fraction is None else f" ({fraction:.0%})"),
      f"  stream      {s['status_comments']} status comments, {s['status_chunks']} status chunks",
      f"  throughput  {s['output_tokens']} output tokens in {s['wall_s']:.2f} s: "
      f"{s['output_tokens_per_s'] or 0:.1f} tokens/s, {s['requests_per_s'] or 0:.2f} requests/s",
      f"  {'latency (ms)':<18} {'mean':>9} {'p50':>9} {'p99':>9}"]
  for name, key in (("TTFT", "ttft_s"), ("TTFT incl. retries", "ttft_incl_retries_s"),
                    ("TPOT", "tpot_s"), ("ITL", "itl_s")):
    figures = s[key]
    lines.append(f"  {name:<18} {_ms(figures['mean']):>9} {_ms(figures['p50']):>9} "
                 f"{_ms(figures['p99']):>9}")
  return "\n".join(lines)
