"""One thread owns the engine; asyncio handlers talk to it through thread-safe queues.

The engine is not thread-safe and need not be: every call into it happens on the
engine thread. The asyncio side sends *commands* (admit a request, abort one, ask for
a queued request's status) through an inbox, and each command runs between two
steps, so admission — the check, and the request's joining of the admitted backlog —
is one atomic step of the scheduler before any response starts. A burst of arrivals
is checked one after another, each against the backlog the previous ones joined.

The thread steps while any request is live and blocks on the inbox otherwise (no
polling). After each step it turns every request's new tokens into text
(`kvpage.serve.detokenize`), matches stop strings — a match ends the request at once,
with finish reason "stop", so no token past it is computed — and hands the deltas of
the whole step to the event loop in one `call_soon_threadsafe`. Device work releases
the GIL, so the event loop serves HTTP while a step runs.

A defect in the engine must not hang clients: if a step raises, every live stream
ends with an error, and the loop refuses new work (`/health` turns 503).
"""

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from kvpage.host.engine import Engine, RequestOutput
from kvpage.interface import Admission
from kvpage.request import Request, RequestStatus, SamplingParams, TokenLogprobs
from kvpage.serve.detokenize import IncrementalDetokenizer, StopStrings, Tokenizer
from kvpage.serve.metrics import FINISH_REASONS, ServerMetrics

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.005  # an engine with live requests but nothing to launch waits this long


@dataclasses.dataclass(frozen=True)
class Submission:
  """What the HTTP layer asks the engine to run."""

  request_id: str
  prompt_ids: list[int]
  sampling: SamplingParams
  priority: int = 0
  max_queue_wait_s: float | None = None
  stop: tuple[str, ...] = ()
  arrival_time: float | None = None  # on the engine's clock; None: when the engine sees it
  include_stop_str: bool = False  # a matched stop string ends the text (else cut before it)
  skip_special_tokens: bool = True
  own_stop_token_ids: tuple[int, ...] = ()  # the client's (not EOS): named as stop_reason
  parent_id: str | None = None  # a sibling of the same prompt (`n > 1`), live, if any
  status_at_admission: bool = False  # where it stands once admitted (`Stream.admitted`)


@dataclasses.dataclass(frozen=True)
class Delta:
  """One step's news for one request: new text and tokens, or how it ended.

  `finish_reason` is set on the last delta: OpenAI's "stop", "length" or "abort", or
  "deadline" when its wait deadline passed before it ran (an error for the client).
  """

  text: str = ""
  token_ids: tuple[int, ...] = ()
  finish_reason: str | None = None
  preempted: bool = False
  num_output_tokens: int = 0
  retry_after: float | None = None  # "deadline": when a retry would meet the deadline
  error: str | None = None  # "error": what failed (the engine, or a fleet's replica)
  # What stopped it, as vLLM names it: the stop string, or the client's stop token id;
  # None for EOS, length and the rest.
  stop_reason: str | int | None = None
  logprobs: tuple[TokenLogprobs, ...] = ()  # of `token_ids`, when the request asks
  # The prompt's (None at position 0), on the delta of the first token, when it asks.
  prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None


@dataclasses.dataclass(frozen=True)
class QueueStatus:
  """Where a live request stands: `state` is "queueing" (never scheduled), "preempted"
  (sent back to wait, or swapped out) or "running"; `position` counts from 1 (next)."""

  state: str
  position: int
  waited_s: float
  eta_s: float


class Stream:
  """The asyncio side of one admitted request: its deltas, in order, and its end.

  `next` hands over one delta at a time, waking its reader in one hop: one future that
  `deliver` resolves, raced against a timer (an `asyncio.wait` over a queue's getter
  task costs three hops, about half a millisecond on the token path of a small host).
  """

  def __init__(self, request_id: str, prompt_ids: Sequence[int],
               loop: asyncio.AbstractEventLoop):
    self.request_id = request_id
    self.prompt_ids = prompt_ids
    self.num_prompt_tokens = len(prompt_ids)
    self.created = int(time.time())  # the responses' `created` (the gateway sets arrival)
    self.response_id = self.request_id  # the response's `id` (n > 1: the choices share one)
    self.done = loop.create_future()  # resolved with the last delta
    # Where the request stood the moment it was admitted, when its submission asked:
    # what a waiting stream is told first, so its ETA is the forecast at admission.
    self.admitted: QueueStatus | None = None
    self._loop = loop
    self._pending: collections.deque[Delta] = collections.deque()
    self._waiter: asyncio.Future | None = None

  async def next(self, timeout_s: float | None = None) -> Delta | None:
    """The next delta, waiting for it; None if `timeout_s` passed first."""
    if not self._pending:
      waiter = self._waiter = self._loop.create_future()
      timer = (None if timeout_s is None
               else self._loop.call_later(timeout_s, _resolve, waiter))
      try:
        await waiter
      finally:
        self._waiter = None
        if timer is not None:
          timer.cancel()
    return self._pending.popleft() if self._pending else None

  @property
  def has_pending(self) -> bool:
    """Whether a delta was delivered and not yet taken."""
    return bool(self._pending)

  def delivered(self) -> list[Delta]:
    """Every delta delivered and not yet taken, taken now."""
    deltas = list(self._pending)
    self._pending.clear()
    return deltas

  def deliver(self, delta: Delta) -> None:  # on the event loop
    self._pending.append(delta)
    if self._waiter is not None:
      _resolve(self._waiter)
    if delta.finish_reason is not None and not self.done.done():
      self.done.set_result(delta)


def _resolve(waiter: asyncio.Future) -> None:
  if not waiter.done():
    waiter.set_result(None)


@dataclasses.dataclass
class _Tracked:
  """Engine-thread state of one live request."""

  request: Request
  stream: Stream
  detokenizer: IncrementalDetokenizer | None
  stops: StopStrings
  own_stop_token_ids: tuple[int, ...] = ()


class EngineStoppedError(RuntimeError):
  """The engine thread stopped on a defect; the server cannot run requests."""


class EngineLoop:
  """Runs `engine` on its own thread; the coroutines below are its asyncio face."""

  def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, *,
               metrics: ServerMetrics, tokenizer: Tokenizer | None = None):
    self.engine = engine
    self.loop = loop
    self.metrics = metrics
    self.tokenizer = tokenizer
    engine.on_step = self._on_step
    self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
    self._tracked: dict[str, _Tracked] = {}
    self._preempted: list[str] = []  # ids preempted by the step just run
    self._idle_waiters: list[concurrent.futures.Future] = []
    self._stopping = False
    self.failure: str | None = None  # the defect that stopped the thread
    self._thread = threading.Thread(target=self._run, name="kvpage-engine", daemon=True)

  # The asyncio side.
  def start(self) -> None:
    self._thread.start()

  @property
  def alive(self) -> bool:
    return self._thread.is_alive() and self.failure is None

  def health(self) -> tuple[str, dict[str, Any]]:
    """`/health`'s answer: "ok", or "error" with the defect that stopped the thread."""
    if self.alive:
      return "ok", {}
    return "error", {"detail": self.failure or "the engine thread is not running"}

  async def call(self, function: Callable[[Engine], Any]) -> Any:
    """`function(engine)`, run on the engine thread between two steps (a read of the
    scheduler's state that must not race a step)."""
    return await self._call(lambda: function(self.engine))

  async def submit(self, submission: Submission) -> tuple[Admission, Stream | None]:
    """Admits or refuses; an admitted request's deltas flow into the returned stream."""
    return await self._call(lambda: self._add(submission))

  async def submit_all(self, submissions: Sequence[Submission]
                       ) -> tuple[Admission, list[Stream] | None]:
    """Admits every submission or none (the siblings of `n > 1`), in one call on the
    engine thread; the streams in order, or None with the refusal."""
    return await self._call(lambda: self._add_all(submissions))

  def abort(self, request_id: str, reason: str = "aborted") -> None:
    """Ends a live request (a client gone); its pages are free before the next step.
    A no-op once the thread has stopped: nothing runs any more."""
    if self.failure is None:
      self._send(lambda: self._abort(request_id, reason))

  async def status(self, request_id: str) -> QueueStatus | None:
    """Where a live request stands; None once it has ended."""
    return await self._call(lambda: self._status(request_id))

  async def wait_idle(self, timeout_s: float) -> bool:
    """Waits until no request is live; False if `timeout_s` passed first."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._send(lambda: self._notify_when_idle(future))
    try:
      await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
      return True
    except asyncio.TimeoutError:
      return False

  async def abort_all(self) -> int:
    """Ends every live request with "abort"; returns how many."""
    return await self._call(self._abort_all)

  def stop(self) -> None:
    """Ends the thread once the commands sent before are done (at once if it died)."""
    if self._thread.is_alive():
      self._inbox.put(self._request_stop)
      self._thread.join()

  async def _call(self, function: Callable[[], Any]) -> Any:
    future: concurrent.futures.Future = concurrent.futures.Future()

    def command() -> None:
      if not future.set_running_or_notify_cancel():
        return  # its handler gave up (the client went away): a submit is not admitted
      try:
        future.set_result(function())
      except BaseException as error:  # handed to the awaiting handler
        future.set_exception(error)

    self._send(command)
    return await asyncio.wrap_future(future)

  def _send(self, command: Callable[[], None]) -> None:
    if self.failure is not None:
      raise EngineStoppedError(self.failure)
    self._inbox.put(command)

  # The engine thread.
  def _run(self) -> None:
    try:
      while not self._stopping:
        self._run_commands(block=not self.engine.has_unfinished())
        if self._stopping or not self.engine.has_unfinished():
          continue
        outputs = self.engine.step()
        self._dispatch(outputs)
        if self.engine.idle_steps:  # live requests, nothing to launch: don't spin
          self._run_commands(block=True, timeout_s=IDLE_WAIT_S)
    except BaseException as error:  # a defect: end every stream, refuse new work
      self.failure = f"{type(error).__name__}: {error}"
      log.error("engine thread stopped:\n%s", traceback.format_exc())
      self._fail_all()

  def _run_commands(self, *, block: bool, timeout_s: float | None = None) -> None:
    try:
      command = self._inbox.get(timeout=timeout_s) if block else self._inbox.get_nowait()
    except queue.Empty:
      return
    while True:
      command()
      try:
        command = self._inbox.get_nowait()
      except queue.Empty:
        return

  def _request_stop(self) -> None:
    self._stopping = True

  def _on_step(self, output: Any, new_tokens: dict[str, list[int]],
               finished: list[Request]) -> None:
    self.metrics.on_step(output, new_tokens, finished)
    self._preempted.extend(p.request_id for p in output.preempted if p.mode != "abort")

  def _add_all(self, submissions: Sequence[Submission]
               ) -> tuple[Admission, list[Stream] | None]:
    """Admits all or none: on the first refusal, the ones admitted before are aborted."""
    streams: list[Stream] = []
    answer: Admission | None = None
    for submission in submissions:
      answer, stream = self._add(submission)
      if stream is None:
        for admitted in streams:
          self._abort(admitted.request_id, "aborted")
        return answer, None
      streams.append(stream)
    assert answer is not None
    return answer, streams

  def _add(self, submission: Submission) -> tuple[Admission, Stream | None]:
    parent = self._tracked.get(submission.parent_id) if submission.parent_id else None
    request, answer = self.engine.add_request(
        submission.prompt_ids, submission.sampling, request_id=submission.request_id,
        priority=submission.priority, max_queue_wait_s=submission.max_queue_wait_s,
        arrival_time=submission.arrival_time,
        parent=None if parent is None else parent.request)
    if not answer.admitted:  # counted as a rejection where it is answered, in the app
      return answer, None
    self.metrics.recorder.track(request)
    detokenizer = (IncrementalDetokenizer(self.tokenizer, request.prompt_ids,
                                          skip_special_tokens=submission.skip_special_tokens)
                   if self.tokenizer is not None else None)
    stream = Stream(request.request_id, request.prompt_ids, self.loop)
    stops = StopStrings(submission.stop, include=submission.include_stop_str)
    self._tracked[request.request_id] = _Tracked(request, stream, detokenizer, stops,
                                                 submission.own_stop_token_ids)
    if submission.status_at_admission:
      stream.admitted = self._status(request.request_id)
    return answer, stream

  def _abort(self, request_id: str, reason: str) -> None:
    tracked = self._tracked.get(request_id)
    if tracked is not None and self.engine.abort(request_id, reason):
      self._end(tracked, [], FINISH_REASONS[reason])
      self._notify_idle()

  def _abort_all(self) -> int:
    ids = list(self._tracked)
    for request_id in ids:
      self._abort(request_id, "aborted")
    return len(ids)

  def _status(self, request_id: str) -> QueueStatus | None:
    tracked = self._tracked.get(request_id)
    if tracked is None:
      return None
    request, scheduler = tracked.request, self.engine.scheduler
    now = scheduler.clock()
    if request.status is RequestStatus.RUNNING:
      return QueueStatus("running", 0, 0.0, 0.0)
    if request.status is RequestStatus.SWAPPED:
      position = scheduler.swapped.index(request) + 1
    else:
      position = scheduler.num_swapped + scheduler.waiting.index(request) + 1
    since = next((e.time for e in reversed(request.events)
                  if e.kind in ("preempted", "admitted")), request.arrival_time)
    state = "preempted" if request.num_preemptions else "queueing"
    eta = scheduler.eta(request_id, first_token=True)
    return QueueStatus(state, position, now - since, 0.0 if eta is None else eta)

  def _notify_when_idle(self, future: concurrent.futures.Future) -> None:
    self._idle_waiters.append(future)
    self._notify_idle()

  def _notify_idle(self) -> None:
    if not self._tracked and not self.engine.has_unfinished():
      for future in self._idle_waiters:
        _settle(future, True)
      self._idle_waiters = []

  def _dispatch(self, outputs: Sequence[RequestOutput]) -> None:
    """Turns one step's outputs into deltas, delivered to the event loop in one call."""
    deliveries = []
    for request_id in self._preempted:
      tracked = self._tracked.get(request_id)
      if tracked is not None:
        deliveries.append((tracked.stream, Delta(preempted=True)))
    self._preempted = []
    for output in outputs:
      tracked = self._tracked.get(output.request_id)
      # An id no longer tracked ended by the gateway's hand (a stop string, an abort). A
      # client may reuse its x-request-id at once: the end of the request that held it
      # before is reported after, and must not end the new one (still live).
      if tracked is None or (output.finished and not tracked.request.is_finished):
        continue
      delta = self._advance(tracked, output)
      if delta is not None:
        deliveries.append((tracked.stream, delta))
    # First tokens first: the event loop writes one stream after another, and a wait
    # for the first token is the one a user sees (TTFT) — an inter-token gap is hidden
    # behind text already on screen.
    deliveries.sort(key=lambda item: item[1].num_output_tokens != len(item[1].token_ids))
    if deliveries:
      self.loop.call_soon_threadsafe(_deliver_all, deliveries)
    self._notify_idle()

  def _advance(self, tracked: _Tracked, output: RequestOutput) -> Delta | None:
    """The delta of one request's output; ends it here on a stop string."""
    text = ""
    if tracked.detokenizer is not None and output.new_token_ids:
      # (`min_tokens`: no stop string ends a request before it has that many tokens)
      armed = tracked.request.num_output_tokens >= tracked.request.sampling.min_tokens
      text = tracked.stops.push(tracked.detokenizer.push(output.new_token_ids), armed)
    if tracked.stops.stopped:  # matched: end now, before another token is computed
      if not output.finished:
        self.engine.abort(output.request_id, "stop")
      return self._end(tracked, output.new_token_ids, "stop", text, deliver=False,
                       stop_reason=tracked.stops.matched, logprobs=output.new_logprobs,
                       prompt_logprobs=output.prompt_logprobs)
    if output.finished:
      reason = output.finish_reason or "aborted"
      # A passed deadline is an error for the client, not one of OpenAI's reasons.
      hint = None
      if reason == "deadline":  # its 429 carries when a retry would meet the deadline
        hint = self.engine.scheduler.deadline_retry_after(tracked.request)
      else:
        reason = FINISH_REASONS.get(reason, "abort")
      last = tracked.request.output_ids[-1:] or [None]
      stop_reason = (last[0] if reason == "stop" and last[0] in tracked.own_stop_token_ids
                     else None)
      return self._end(tracked, output.new_token_ids, reason, text, deliver=False,
                       retry_after=hint, stop_reason=stop_reason, logprobs=output.new_logprobs,
                       prompt_logprobs=output.prompt_logprobs)
    if not text and not output.new_token_ids:
      return None
    return Delta(text, tuple(output.new_token_ids), logprobs=output.new_logprobs,
                 prompt_logprobs=output.prompt_logprobs,
                 num_output_tokens=tracked.request.num_output_tokens)

  def _end(self, tracked: _Tracked, token_ids: Sequence[int], finish_reason: str,
           text: str = "", *, deliver: bool = True, retry_after: float | None = None,
           stop_reason: str | int | None = None,
           logprobs: tuple[TokenLogprobs, ...] = (),
           prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None) -> Delta:
    """The last delta of a request: held-back text flushed, metrics read, forgotten."""
    del self._tracked[tracked.request.request_id]
    if tracked.detokenizer is not None and not tracked.stops.stopped:
      text += tracked.stops.push(tracked.detokenizer.flush())
      text += tracked.stops.flush()
    self.metrics.ended(tracked.request)
    delta = Delta(text, tuple(token_ids), finish_reason,
                  num_output_tokens=tracked.request.num_output_tokens, retry_after=retry_after,
                  stop_reason=stop_reason, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    if deliver:
      self.loop.call_soon_threadsafe(tracked.stream.deliver, delta)
    return delta

  def _fail_all(self) -> None:
    deliveries = [(tracked.stream, Delta(finish_reason="error",
                                         error=f"the engine stopped: {self.failure}"))
                  for tracked in self._tracked.values()]
    self._tracked = {}
    if deliveries:
      self.loop.call_soon_threadsafe(_deliver_all, deliveries)
    for future in self._idle_waiters:
      _settle(future, False)
    self._idle_waiters = []


def _settle(future: concurrent.futures.Future, result: Any) -> None:
  """Resolves `future` unless its waiter gave up (`wait_idle`'s timeout cancels it)."""
  if future.set_running_or_notify_cancel():
    future.set_result(result)


def _deliver_all(deliveries: list[tuple[Stream, Delta]]) -> None:
  for stream, delta in deliveries:
    stream.deliver(delta)
