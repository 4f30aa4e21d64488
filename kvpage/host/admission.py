"""Admission at arrival: push back in pages, not requests per second.

A request's weight is the KV memory it will occupy, so the gateway estimates it in
pages — prompt tokens plus the output tokens it is expected to produce — before the
request may queue. The answers, checked in this order:

  * **400** it can never fit: prompt + max_tokens exceeds the model's context, needs
    more pages than the whole pool, or its estimate would break the watermark even in
    an empty cache; or its prompt holds ids outside the vocabulary. Retrying cannot help.
  * **503** cache pressure: this estimate, plus the estimates of the requests already
    admitted but not running (waiting or swapped out), plus the rest of the prompts
    that running requests are still prefilling, would leave fewer free pages than the
    watermark. The memory line is held first, so when both the cache and the
    queue say no, the client hears about the cache.
  * **429** the waiting queue is full (`max_waiting`; 0 = unbounded).
  * **200** admitted.

Other lines an operator may hold instead or as well, each off at 0, so the studies can
set them against the KV line (`experiments/line_study.py`):

  * **429** `rate_limited`: a token bucket of `rate_limit` requests/s holding at most
    `rate_burst`, the API gateway's rate limit. It stands in front of every other line
    (a request it refuses is never weighed), and a request that passes it spends a token
    whatever the lines behind it answer. Its hint is exact: when the next token is due.
  * **503** `token_budget`: the prompt plus expected output tokens of every admitted,
    unfinished request, this one's included, would exceed `max_inflight_tokens` (a 400
    `exceeds_token_budget` if this request's own would).
  * **429** `concurrency_limit`: `max_concurrent` requests are admitted and unfinished
    (TGI's `max_concurrent_requests`).
  * **429** `wait_forecast`: the forecast time to first token (from the request's
    arrival at the server) exceeds `max_forecast_ttft_s` (for a prompt too long for that
    line even on an idle engine: twice its idle time), or `max_ttft_slowdown` times
    the request's time to first token on an idle engine (checked by the scheduler once
    the request is in line, `Scheduler.add_request`): for requests that name no
    deadline of their own.

Their order: the 400s, the rate limit, the cache (503), the token budget (503), the
concurrency limit (429), the queue (429), the forecast TTFT (429).

That is `admission="watermark"`, kvpage's policy. `admission="queue_only"` is how vLLM
behaves: no cache-pressure 503 and no watermark 400, only the queue bound answers 429
(and with `max_waiting=0` nothing does: every request queues, as in vLLM before v0.29),
so the simulator can reproduce other systems and the studies can compare against them.

The free pages below the watermark are what running requests grow into; refusing at
the door is what keeps them from being preempted later. Expected output length is a
policy: the request's `max_tokens` (the most cautious), a fixed number, or the
running mean of finished outputs (overcommits on purpose and lets preemption absorb
the tail, the bet vLLM makes, SOSP'23 section 4.5). With prefix caching, the pages a
request would share with running requests are not counted: admission counts what is
really new. Only requests that hold no pages
yet are counted at their estimate: once running, a request counts the pages it holds
plus the rest of its prompt while it is prefilled in chunks (certain growth: an
8,000-token prompt one chunk in holds a sixteenth of what it will), and its output's
further growth is what the watermark's free pages are for. Under sustained
load of long outputs that buffer can run out, and preemption takes over; reserving
each running request's full remaining growth would never preempt, at the price of a
mostly idle cache.

A rejection carries `retry_after`, raw seconds from the one wait estimator
(`kvpage.host.wait_estimate`): when the check that refused it is forecast to pass,
the scheduler's own rules run ahead over what it holds, behind every client told to
come back before it. With `retry_reservations` on, a refusal also holds the request's
place under its id until it comes back: every request is then measured against the
lines after the places due ahead of it (their pages, a queue place each), so a
promised client returning with its id is admitted ahead of newcomers.

Pure Python: never imports jax.
"""

import collections
import contextlib
from collections.abc import Callable, Iterator, Sequence

import ml_collections

from kvpage.host import forecast, prefix_cache
from kvpage.host.forecast import Queues
from kvpage.host.pages import PagePool
from kvpage.host.wait_estimate import WaitEstimator
from kvpage.interface import BAD_REQUEST, OK, SERVICE_UNAVAILABLE, TOO_MANY_REQUESTS, Admission
from kvpage.request import Request


class AdmissionControl:
  """Estimates pages per request, tracks the admitted backlog, and answers arrivals."""

  def __init__(self, config: ml_collections.ConfigDict, page_pool: PagePool,
               max_model_len: int, vocab_size: int | None = None):
    self.config = config
    self.page_pool = page_pool
    self.max_model_len = max_model_len
    self.vocab_size = vocab_size
    self.watermark_pages = config.watermark * page_pool.num_usable_pages
    self._recent_outputs: collections.deque[int] = collections.deque(
        maxlen=config.output_estimate_window)
    self._recent_outputs_sum = 0
    self._backlog: dict[str, int] = {}  # estimated pages of admitted, non-running requests
    self.num_backlog_pages = 0
    self.wait = WaitEstimator(config, page_pool, self.watermark_pages, self._backlog)
    self._bucket = (float(config.rate_burst), float("-inf"))  # (tokens, when last filled)
    self._probing = False  # inside `probing()`: answers only, no side effects
    self._owed_by_key: tuple[object, int] = (None, 0)  # see `_owed`

  @contextlib.contextmanager
  def probing(self) -> Iterator[None]:
    """Inside, `decide` answers without side effects: it computes no hint (a refusal's
    `retry_after` is 0) and spends no rate-limit token, so a probe
    (`Scheduler.would_admit`) may ask it at any moment. (A reservation is released by
    the scheduler, once every line admitted the request.)"""
    self._probing = True
    try:
      yield
    finally:
      self._probing = False

  def hint(self, estimate: Callable[..., float], *args: object, **kwargs: object) -> float:
    """`estimate(*args, **kwargs)`, a retry hint (which may enter the request in the
    line), or 0 when probing."""
    return 0.0 if self._probing else estimate(*args, **kwargs)

  def expected_output_tokens(self, request: Request) -> int:
    """Output tokens `request` is expected to produce in total, per `output_estimate`."""
    max_tokens = request.sampling.max_tokens
    policy = self.config.output_estimate
    if policy == "fixed":
      expected = self.config.fixed_output_estimate
    elif policy == "running_mean" and self._recent_outputs:
      expected = round(self._recent_outputs_sum / len(self._recent_outputs))
    else:  # "max_tokens", or "running_mean" before anything has finished.
      expected = max_tokens
    # Never less than what it already has (plus the token it is about to sample).
    return min(max_tokens, max(expected, request.num_output_tokens + 1))

  def estimate_pages(self, request: Request) -> int:
    """New pages `request` is expected to take at its peak: the pages its tokens fill,
    less the cached prefix pages it would share with running requests (prefix caching:
    those cost no free page; a cached page nobody holds is free already, and taking
    it back costs one)."""
    pool = self.page_pool
    tokens = request.num_prompt_tokens + self.expected_output_tokens(request)
    pages = pool.pages_for(tokens)
    if pool.prefix is None or request.num_output_tokens:
      return pages
    max_pages = (request.num_prompt_tokens - 1) // pool.page_size
    hashes = prefix_cache.request_hashes(request, max_pages * pool.page_size, pool.page_size)
    return pages - pool.num_shared(pool.cached_prefix(hashes, max_pages))

  def decide(self, request: Request, now: float, queues: Queues) -> Admission:
    """400, 503, 429 or 200 for an arriving request (see the module docstring); the
    scheduler's `queues` feed the wait estimator's forecast."""
    rid, pool = request.request_id, self.page_pool
    max_tokens = request.sampling.max_tokens
    total = request.num_prompt_tokens + max_tokens
    if request.num_prompt_tokens == 0:
      return Admission(BAD_REQUEST, "empty prompt", None, rid, "empty_prompt")
    if total > self.max_model_len:
      return Admission(BAD_REQUEST, f"prompt ({request.num_prompt_tokens}) + max_tokens "
                       f"({max_tokens}) = {total} tokens exceeds max_model_len "
                       f"{self.max_model_len}", None, rid, "context_length_exceeded")
    if pool.pages_for(total) > pool.num_usable_pages:
      return Admission(BAD_REQUEST, f"{total} tokens need {pool.pages_for(total)} pages, more "
                       f"than the whole pool ({pool.num_usable_pages})", None, rid,
                       "exceeds_pool")
    if self.vocab_size is not None:
      bad = [t for t in request.prompt_ids if not 0 <= t < self.vocab_size]
      if bad:
        return Admission(BAD_REQUEST, f"prompt token ids {bad[:5]} are outside the vocabulary "
                         f"[0, {self.vocab_size})", None, rid, "invalid_token_ids")
    estimate = self.estimate_pages(request)
    # The smallest this estimate can ever be: the same for fixed policies, the prompt
    # plus one token once a running mean may shrink it. Above a line even then, the
    # request can never be admitted and a 503 would have the client retry forever.
    running_mean = self.config.output_estimate == "running_mean"
    floor = pool.pages_for(request.num_prompt_tokens + 1) if running_mean else estimate
    kv_line = self.config.admission != "queue_only"
    if kv_line and pool.num_usable_pages - floor < self.watermark_pages:
      return Admission(BAD_REQUEST, f"an estimated {floor} pages would break the watermark "
                       f"({self.watermark_pages:.1f} of {pool.num_usable_pages} pages kept free) "
                       "even in an empty cache", None, rid, "exceeds_watermark")
    budget = self.config.max_inflight_tokens
    least_tokens = request.num_prompt_tokens + (
        1 if running_mean else self.expected_output_tokens(request))
    if budget and least_tokens > budget:
      return Admission(BAD_REQUEST, f"{least_tokens} tokens (prompt + expected output) exceed "
                       f"the in-flight token budget ({budget}) on their own", None, rid,
                       "exceeds_token_budget")
    if self.config.rate_limit:
      refused = self._rate_limit(request, now)
      if refused is not None:
        return refused
    if not kv_line:
      return self._load_lines(request, now, queues)
    reserved = self.wait.reserved_ahead(rid, now)
    owed = self._owed(queues)
    left = self.pages_left(estimate, owed=owed) - reserved
    if left + self.wait.slack_pages(rid, now) < self.watermark_pages:
      held = f" + {reserved} reserved for rejected requests ahead of it" if reserved else ""
      prompts = f" + {owed} for the rest of running prompts" if owed else ""
      return Admission(
          SERVICE_UNAVAILABLE,
          f"cache pressure: {estimate} pages for this request + {self.num_backlog_pages} for "
          f"admitted waiting requests{prompts}{held} would leave {left} of "
          f"{pool.num_free_pages} free pages, under the watermark of "
          f"{self.watermark_pages:.1f}",
          self.hint(self.wait.retry_after_pages, request, estimate, now, queues), rid,
          "kv_pressure")
    return self._load_lines(request, now, queues)

  def _rate_limit(self, request: Request, now: float) -> Admission | None:
    """The token bucket: a 429 when it holds less than one token, else spends one."""
    rate, burst = self.config.rate_limit, self.config.rate_burst
    tokens, filled = self._bucket
    tokens = min(float(burst), tokens + (now - filled) * rate)
    if tokens < 1.0:
      if not self._probing:
        self._bucket = (tokens, now)
      return Admission(TOO_MANY_REQUESTS, f"rate limited: {rate:g} requests/s (burst {burst})",
                       (1.0 - tokens) / rate, request.request_id, "rate_limited")
    if not self._probing:
      self._bucket = (tokens - 1.0, now)
    return None

  def _load_lines(self, request: Request, now: float, queues: Queues) -> Admission:
    """The lines on what is admitted: the token budget (503), the concurrency limit
    (429) and the queue bound (429); else 200."""
    rid = request.request_id
    admitted = (*queues.running, *queues.swapped, *queues.waiting)
    budget = self.config.max_inflight_tokens
    if budget:
      weight = {r.request_id: float(r.num_prompt_tokens + self.expected_output_tokens(r))
                for r in admitted}
      tokens = request.num_prompt_tokens + self.expected_output_tokens(request)
      inflight = sum(weight.values())
      # Nothing in flight: nothing would end to make room, so a request whose floor fits
      # (the 400 check) is let in rather than told to wait forever.
      if inflight and inflight + tokens > budget:
        return Admission(
            SERVICE_UNAVAILABLE, f"token budget: {tokens} tokens for this request + "
            f"{inflight:.0f} in flight exceed max_inflight_tokens {budget}",
            self.hint(self.wait.retry_after_ends, inflight + tokens - budget, now, queues,
                      weight), rid, "token_budget")
    limit = self.config.max_concurrent
    if limit and len(admitted) >= limit:
      return Admission(TOO_MANY_REQUESTS, f"concurrency limit: {len(admitted)} requests "
                       f"admitted and unfinished (max_concurrent {limit})",
                       self.hint(self.wait.retry_after_ends, len(admitted) - limit + 1, now,
                                 queues), rid, "concurrency_limit")
    return self._queue_bound(request, now, queues)

  def _queue_bound(self, request: Request, now: float, queues: Queues) -> Admission:
    """429 when the waiting queue is full, else 200."""
    rid, bound = request.request_id, self.config.max_waiting
    held = self.wait.ahead(rid, now).places if bound else 0
    num_waiting = len(queues.waiting) + held
    if bound and num_waiting >= bound:
      places = f" + {held} places held for refused requests ahead of it" if held else ""
      return Admission(TOO_MANY_REQUESTS, f"waiting queue full ({len(queues.waiting)} of "
                       f"{bound}{places})",
                       self.hint(self.wait.retry_after_slots, request,
                                 num_waiting - bound + 1, now, queues,
                                 self.estimate_pages(request)), rid, "queue_full")
    return Admission(OK, "admitted", None, rid)

  def _owed(self, queues: Queues) -> int:
    """`owed_pages` of the running requests, once per state of the queues: the retry
    audit asks every refusal it watches at every step."""
    key, owed = self._owed_by_key
    if key != queues.key or key is None:
      owed = self.owed_pages(queues.running)
      self._owed_by_key = (queues.key, owed)
    return owed

  def owed_pages(self, running: Sequence[Request]) -> int:
    """Pages the `running` requests still prefilling will take for the rest of their
    prompts (beyond the pages they hold)."""
    page_size = self.page_pool.page_size
    return sum(forecast.job_of(request).owed_pages(page_size) for request in running)

  def pages_left(self, estimate: int, running: Sequence[Request] = (), *,
                 owed: int | None = None) -> int:
    """Free pages left after the rest of the `running` prompts (or `owed` pages, when
    counted already), the admitted backlog and a request of `estimate` pages (before
    any reservation: see `WaitEstimator.reserved_ahead`)."""
    if owed is None:
      owed = self.owed_pages(running)
    return self.page_pool.num_free_pages - owed - self.num_backlog_pages - estimate

  def admissible(self, request: Request, num_waiting: int, now: float = 0.0,
                 running: Sequence[Request] = ()) -> bool:
    """Whether the cache and the queue would take `request` now (one that passed the
    400 checks), behind the reservations ranked ahead of its id and the rest of the
    `running` prompts; no side effects beyond releasing lapsed reservations, so a study
    can probe it at any moment."""
    bound = self.config.max_waiting
    queue_ok = not bound or num_waiting + self.wait.ahead(request.request_id, now).places < bound
    if self.config.admission == "queue_only":
      return queue_ok
    rid = request.request_id
    left = (self.pages_left(self.estimate_pages(request), running)
            - self.wait.reserved_ahead(rid, now) + self.wait.slack_pages(rid, now))
    return left >= self.watermark_pages and queue_ok

  # Bookkeeping the scheduler calls.
  def add_backlog(self, request: Request) -> None:
    """Counts an admitted request that holds no device pages (waiting or swapped)."""
    estimate = self.estimate_pages(request)
    self._backlog[request.request_id] = estimate
    self.num_backlog_pages += estimate

  def remove_backlog(self, request: Request) -> None:
    self.num_backlog_pages -= self._backlog.pop(request.request_id, 0)

  def record_output(self, request: Request) -> None:
    """An output length for the running mean (requests that ended by length or stop)."""
    if len(self._recent_outputs) == self._recent_outputs.maxlen:
      self._recent_outputs_sum -= self._recent_outputs[0]
    self._recent_outputs.append(request.num_output_tokens)
    self._recent_outputs_sum += request.num_output_tokens
