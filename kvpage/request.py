"""A request as the host sees it: tokens in, tokens out, pages held, and a diary.

A `Request` carries everything the scheduler decides on — prompt ids, sampling
parameters, priority, arrival time — and everything it decided: its status, the
tokens generated so far, the KV pages it holds (`page_ids`, its page table: a
token at position `p` lives in page `page_ids[p // page_size]`), and how many
tokens already have their keys and values in the cache (`num_computed_tokens`).

Token accounting follows one rule so that prefill, chunked prefill, decode and
recompute after preemption are the same operation: the tokens to compute at a step
are `all_token_ids[num_computed_tokens : num_computed_tokens + n]`. A decode is the
case n = 1: the last sampled token is not in the cache yet. A step samples a new
token iff it brings `num_computed_tokens` up to `num_tokens`. The scheduler advances
`num_computed_tokens` when it schedules a step, and counts the token the step will
sample in `num_pending` until the host learns its value; under async scheduling the
next step is scheduled before that, and feeds the pending token as a `PLACEHOLDER`
that the device fills in from the previous step's samples.

Every decision lands in `events` with a timestamp (queued, admitted or rejected,
scheduled, preempted, swapped out/in, first token, finished, aborted), so metrics
and the gateway read one log instead of reconstructing what happened.

Pure Python: never imports jax.
"""

import dataclasses
import enum
import math
from typing import Any, NamedTuple

_INT32_LIMIT = 2**31  # the device keeps top_k as int32

# Stands for a token sampled by a step still in flight: its value is on the device only.
PLACEHOLDER = -1
MAX_LOGPROBS = 20  # the most top log-probabilities a request may ask for (vLLM's default)


class TokenLogprobs(NamedTuple):
  """A sampled token's log-probability (float32 log-softmax of the model's logits, before
  temperature, top-k and top-p) and the `top` likeliest `(token id, log-probability)`."""

  token_id: int
  logprob: float
  top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to pick tokens and when to stop; `max_tokens` bounds the generated tokens. A
  token of `stop_token_ids` ends the request (unless `ignore_eos`), once it has more
  than `min_tokens` tokens."""

  max_tokens: int
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int | None = None
  stop_token_ids: tuple[int, ...] = ()
  ignore_eos: bool = False
  min_tokens: int = 0
  # Log-probabilities of each sampled token and of the `logprobs` likeliest (0: the
  # sampled token's only; None: none), from the step that sampled it.
  logprobs: int | None = None
  # The same for every prompt token after the first (each scored by the logits at the
  # token before it; `echo` with logprobs): computed, never read from the prefix cache.
  prompt_logprobs: int | None = None

  def __post_init__(self) -> None:
    if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
      raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
    # Written as `not (in range)` so that NaN, which compares false, is refused too.
    if (not 0 <= self.temperature < math.inf or not 0 <= self.top_k < _INT32_LIMIT
        or not 0 < self.top_p <= 1):
      raise ValueError(
          f"need finite temperature >= 0, 0 <= top_k < 2^31 and 0 < top_p <= 1; got "
          f"temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p}")
    if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
      raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                       f"got {self.min_tokens!r}")
    for name in ("logprobs", "prompt_logprobs"):
      value = getattr(self, name)
      if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value!r}")
    object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))


class RequestStatus(enum.Enum):
  WAITING = "waiting"  # admitted; holds no device pages (new, or preempted by recompute)
  RUNNING = "running"  # holds device pages; scheduled when the budget allows
  SWAPPED = "swapped"  # preempted by swap: its pages sit in the host pool
  FINISHED = "finished"  # done: `finish_reason` says why; holds nothing
  REJECTED = "rejected"  # refused at admission; never held anything


@dataclasses.dataclass(frozen=True)
class Event:
  """One timestamped entry of a request's log; `detail` holds kind-specific facts."""

  time: float
  kind: str
  detail: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(eq=False)
class Request:
  """One generation request and its state; the scheduler owns every mutable field.

  `arrival_time` is stamped by `Scheduler.add_request` from its clock when left None.
  """

  request_id: str
  prompt_ids: list[int]
  sampling: SamplingParams
  priority: int = 0  # lower value = more important, as in vLLM
  arrival_time: float | None = None
  # Longest it may wait, from arrival, to be first scheduled; None = as long as it takes.
  # Refused at admission if the forecast wait is longer; ended ("deadline") when it passes.
  max_queue_wait_s: float | None = None
  status: RequestStatus = RequestStatus.WAITING
  output_ids: list[int] = dataclasses.field(default_factory=list)
  # With `sampling.logprobs`: one entry per token of `output_ids`, as the steps return them.
  output_logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
  # With `sampling.prompt_logprobs`: by prompt position (None at 0, and until computed).
  prompt_logprobs: list[TokenLogprobs | None] = dataclasses.field(default_factory=list)
  page_ids: list[int] = dataclasses.field(default_factory=list)
  host_page_ids: list[int] = dataclasses.field(default_factory=list)
  num_computed_tokens: int = 0
  num_pending: int = 0  # tokens sampled by scheduled steps, not yet in output_ids
  finish_reason: str | None = None  # "length", "stop", "preempted", "aborted" or "deadline"
  events: list[Event] = dataclasses.field(default_factory=list)
  num_preemptions: int = 0
  admission_index: int = -1  # order of admission: breaks priority ties, newest first
  # Chain hashes of its full pages of known tokens (`kvpage.host.prefix_cache`), as
  # far as prefix caching has needed them.
  page_hashes: list[bytes] = dataclasses.field(default_factory=list)
  # A sibling of the same prompt (`n > 1`): with prefix caching, it waits to be
  # scheduled until `parent` has sampled its first token, then reads the prompt's pages
  # from the cache instead of computing them again.
  parent: "Request | None" = dataclasses.field(default=None, repr=False)

  def __post_init__(self) -> None:
    self.prompt_ids = list(self.prompt_ids)
    wait = self.max_queue_wait_s
    if wait is not None and not 0 < wait < math.inf:  # NaN fails the comparison too
      raise ValueError(f"max_queue_wait_s must be a finite number of seconds > 0, got {wait!r}")

  def log(self, time: float, kind: str, **detail: Any) -> None:
    """Appends an event to this request's log."""
    self.events.append(Event(time, kind, detail))

  @property
  def all_token_ids(self) -> list[int]:
    """Prompt then generated tokens: the sequence whose keys and values the cache holds."""
    return self.prompt_ids + self.output_ids

  @property
  def num_tokens(self) -> int:
    """Prompt, generated and pending tokens: the sequence's length once steps land."""
    return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

  @property
  def num_sampled(self) -> int:
    """Tokens generated so far, those still in flight included."""
    return len(self.output_ids) + self.num_pending

  @property
  def num_prompt_tokens(self) -> int:
    return len(self.prompt_ids)

  @property
  def num_output_tokens(self) -> int:
    return len(self.output_ids)

  @property
  def is_finished(self) -> bool:
    return self.status in (RequestStatus.FINISHED, RequestStatus.REJECTED)

  def token_ids(self, start: int, stop: int) -> list[int]:
    """`all_token_ids[start:stop]` without building the whole list (the hot path).

    Positions of pending tokens (sampled, value not yet known) read `PLACEHOLDER`.
    """
    num_prompt = len(self.prompt_ids)
    known = num_prompt + len(self.output_ids)
    if stop > known:
      return self.token_ids(start, known) + [PLACEHOLDER] * (stop - max(start, known))
    if start >= num_prompt:
      return self.output_ids[start - num_prompt:stop - num_prompt]
    if stop <= num_prompt:
      return self.prompt_ids[start:stop]
    return self.prompt_ids[start:] + self.output_ids[:stop - num_prompt]

  def stop_reason(self, token: int) -> str | None:
    """Why the request ends after sampling `token`: "stop", "length", or None to go on."""
    if (token in self.sampling.stop_token_ids and not self.sampling.ignore_eos
        and len(self.output_ids) > self.sampling.min_tokens):
      return "stop"
    if len(self.output_ids) >= self.sampling.max_tokens:
      return "length"
    return None

  def event_kinds(self) -> list[str]:
    """The kinds of this request's events, in order (handy for tests and debugging)."""
    return [event.kind for event in self.events]
