"""The serving loop: schedule -> build batch -> execute -> update -> outputs.

`Engine` joins the host world (scheduler, page pool) and the device world (an
executor) and is model-agnostic: it speaks only `SchedulerOutput` and sampled token
ids. An offline API in the spirit of vLLM's `LLM`: `add_request` returns the admission
answer, `step` runs one iteration and returns each request's new tokens and whether
it finished, `abort` ends a request, `generate` runs a batch of prompts to the end.
Host side: this module, like the scheduler, never imports jax; the executor does.

With `async_scheduling` (vLLM's option of that name) the loop is pipelined through
the executor's `submit`/`collect`: step N+1 is scheduled, built and launched while
step N still runs on the device, and step N's samples are applied after. The host's
work hides behind the device's; what a request sees changes only in timing:
`step()` returns the tokens of the step before, and a request that stops on a stop
token has one extra token computed for it, then dropped.

Multi-step decoding (`scheduler.num_decode_steps`) composes with both loops: a launch
then carries several decode iterations, and its outputs list each request's tokens
of all of them, up to a stop token.
"""

import itertools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from kvpage.host.scheduler import Admission, Scheduler
from kvpage.interface import Executor, Samples, SchedulerOutput
from kvpage.request import Request, RequestStatus, SamplingParams, TokenLogprobs

MAX_IDLE_STEPS = 1000  # empty steps in a row before `generate` declares a stall


class RequestOutput(NamedTuple):
  """What one step did for one request (a NamedTuple: built for every request, every step)."""

  request_id: str
  new_token_ids: list[int]
  finished: bool
  finish_reason: str | None
  status: str
  # With `SamplingParams.logprobs`: the new tokens' log-probabilities, one each.
  new_logprobs: tuple[TokenLogprobs, ...] = ()
  # With `SamplingParams.prompt_logprobs`, on the output of its first token: the
  # prompt's, by position (None at 0).
  prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None


class Engine:
  """A scheduler and an executor, stepped together."""

  def __init__(self, scheduler: Scheduler, executor: Executor,
               on_step: Callable[..., None] | None = None, *, async_scheduling: bool = False):
    self.scheduler = scheduler
    self.executor = executor
    self.async_scheduling = async_scheduling
    self._in_flight: tuple[SchedulerOutput, Any] | None = None  # launched, not collected
    # e.g. a metrics recorder: on_step(output, {request_id: new token ids}, finished)
    self.on_step = on_step
    self._ids = itertools.count()
    self.idle_steps = 0  # consecutive steps that scheduled nothing
    self._reported: set[Request] = set()  # finished in update(), not yet echoed by schedule()

  @property
  def clock(self) -> Callable[[], float]:
    return self.scheduler.clock

  def add_request(self, prompt_ids: Sequence[int], sampling: SamplingParams, *,
                  request_id: str | None = None, priority: int = 0,
                  arrival_time: float | None = None,
                  max_queue_wait_s: float | None = None,
                  parent: Request | None = None) -> tuple[Request, Admission]:
    """Submits a request (`parent`: a sibling of the same prompt, see `Request`); the
    admission answer says 200 (queued) or why not."""
    request = Request(request_id or f"req-{next(self._ids)}", list(prompt_ids), sampling,
                      priority=priority, arrival_time=arrival_time,
                      max_queue_wait_s=max_queue_wait_s, parent=parent)
    return request, self.scheduler.add_request(request)

  def abort(self, request_id: str, reason: str = "aborted") -> bool:
    """Ends a live request with finish reason `reason`; False if it is not live."""
    return self.scheduler.abort(request_id, reason)

  def price_steps(self) -> int:
    """Teaches the wait forecast (retry hints, ETAs) what steps cost before the first
    request: the executor's `measure_steps` at the scheduler's limits, each observed as
    a step; returns how many. Call after warm-up (a first run compiles)."""
    rules = self.scheduler.config
    measured = self.executor.measure_steps(rules.max_num_seqs, rules.max_num_batched_tokens)
    for num_tokens, context, num_sequences, seconds in measured:
      self.scheduler.admission.wait.observe_step(num_tokens, context, num_sequences, seconds)
    return len(measured)

  def has_unfinished(self) -> bool:
    """True while a request is live or a launched step is not collected yet."""
    return self.scheduler.has_unfinished() or self._in_flight is not None

  def step(self) -> list[RequestOutput]:
    """One iteration; returns an output for every request that produced or finished.

    Under async scheduling the outputs are those of the step launched one call earlier.
    """
    output = self.scheduler.schedule()
    self.idle_steps = self.idle_steps + 1 if output.is_empty and not self._in_flight else 0
    if not self.async_scheduling:
      return self._complete(output, self.executor.execute(output))
    previous = self._in_flight
    # Queued on the device behind the step in flight. An empty step launches nothing,
    # so there is no ticket to wait for.
    self._in_flight = None if output.is_empty else (output, self.executor.submit(output))
    outputs = []
    if previous is not None:  # Waits for the previous step while this one is queued.
      outputs += self._complete(previous[0], self.executor.collect(previous[1]))
    if output.is_empty:  # Nothing launched: report what it says (aborts, rejections) now.
      outputs += self._complete(output, {})
    return outputs

  def _complete(self, output: SchedulerOutput, sampled: Samples) -> list[RequestOutput]:
    """Applies a step's samples to the scheduler; the outputs of `step()`."""
    # Requests that finished after this step was scheduled (aborted, or stopped by the
    # step before) were reported then; their samples are void.
    void = {seq.request_id for seq in output.scheduled
            if seq.request.status is RequestStatus.FINISHED}
    sampled = {request_id: token for request_id, token in sampled.items()
               if request_id not in void}
    before = {seq.request_id: len(seq.request.output_ids) for seq in output.scheduled
              if seq.request_id in sampled}
    finished = self.scheduler.update(output, sampled)
    # What update() appended: each sampled token, or a multi-step decode's tokens up to
    # a stop token.
    new_tokens = {seq.request_id: seq.request.output_ids[before[seq.request_id]:]
                  for seq in output.scheduled if seq.request_id in before}
    new_logprobs = self._attach_logprobs(output, new_tokens)
    prompt_logprobs = self._attach_prompt_logprobs(output, before, new_tokens)
    if self.on_step is not None:
      self.on_step(output, new_tokens, finished)
    # Keyed by the request itself, not its id: an id reused after an abort names two
    # requests, and each must report its own end. Earlier ends (abort, preemption) come
    # first, so a reused id streams the old request's end before the new one's tokens.
    # `output.finished` repeats requests that the previous `update` finished (and
    # reported); only those that ended otherwise are new here.
    touched: dict[Request, list[int]] = {}  # each request's new tokens, in report order
    for request in output.finished:
      if request not in self._reported:
        touched[request] = []
      self._reported.discard(request)
    for seq in output.scheduled:
      if seq.request_id not in void:
        touched[seq.request] = new_tokens.get(seq.request_id, [])
    for request in finished:
      self._reported.add(request)
    return [RequestOutput(request.request_id, tokens, request.status is RequestStatus.FINISHED,
                          request.finish_reason, request.status.value,
                          new_logprobs.get(request.request_id, ()),
                          prompt_logprobs.get(request.request_id))
            for request, tokens in touched.items()
            if request.request_id in sampled or request.status is RequestStatus.FINISHED]

  def _attach_prompt_logprobs(self, output: SchedulerOutput, before: dict[str, int],
                              new_tokens: dict[str, list[int]]
                              ) -> dict[str, tuple[TokenLogprobs | None, ...]]:
    """The step's prompt log-probabilities (`Executor.prompt_logprobs`), into their
    requests' `prompt_logprobs` by position; returns, by request id, the whole prompt's
    for each request that sampled its first token in this step."""
    asking = [seq for seq in output.scheduled if seq.request.sampling.prompt_logprobs is not None]
    if not asking:
      return {}
    computed = self.executor.prompt_logprobs()
    whole = {}
    for seq in asking:
      request = seq.request
      if not request.prompt_logprobs:
        request.prompt_logprobs = [None] * request.num_prompt_tokens
      for position, entry in computed.get(seq.request_id, ()):
        request.prompt_logprobs[position] = entry
      if before.get(seq.request_id) == 0 and new_tokens.get(seq.request_id):
        whole[seq.request_id] = tuple(request.prompt_logprobs)
    return whole

  def _attach_logprobs(self, output: SchedulerOutput, new_tokens: dict[str, list[int]]
                       ) -> dict[str, tuple[TokenLogprobs, ...]]:
    """The step's log-probabilities (`Executor.logprobs`) of the tokens `update` kept,
    appended to their requests' `output_logprobs`; by request id."""
    computed = self.executor.logprobs()
    if not computed:  # (the common case: nobody asked, no loop over the step)
      return {}
    attached: dict[str, tuple[TokenLogprobs, ...]] = {}
    for seq in output.scheduled:
      entry = computed.get(seq.request_id)
      tokens = new_tokens.get(seq.request_id)
      if entry is not None and tokens and seq.request.sampling.logprobs is not None:
        # (one token a step: multi-step decoding never carries a request that asks)
        seq.request.output_logprobs.append(entry)
        attached[seq.request_id] = (entry,)
    return attached

  def generate(self, prompts: Sequence[Sequence[int]],
               sampling: SamplingParams | Sequence[SamplingParams]) -> list[Request]:
    """Runs `prompts` to completion together; returns their requests (outputs inside)."""
    samplings = ([sampling] * len(prompts) if isinstance(sampling, SamplingParams)
                 else list(sampling))
    requests: list[Request] = []
    for prompt, params in zip(prompts, samplings, strict=True):
      request, answer = self.add_request(prompt, params)
      if not answer.admitted:
        for admitted in requests:
          self.abort(admitted.request_id)
        raise ValueError(f"prompt {len(requests)} rejected ({answer.status}): {answer.reason}")
      requests.append(request)
    self.run_until_done()
    return requests

  def run_until_done(self) -> None:
    """Steps until no request is left and no launched step is uncollected; raises if the
    loop stops making progress."""
    # `has_unfinished` counts the step in flight: under async scheduling the last request
    # may finish (a stop token) while the step after it is launched, and that step
    # must still be collected. Collecting it is progress: `idle_steps` counts only
    # steps that launch nothing while nothing is in flight.
    while self.has_unfinished():
      self.step()
      if self.idle_steps > MAX_IDLE_STEPS:
        raise RuntimeError(f"no progress in {MAX_IDLE_STEPS} steps with "
                           f"{self.scheduler.num_waiting} waiting and "
                           f"{self.scheduler.num_running} running requests")
