"""What the scheduler hands the batch builder and the executor for one step.

`SchedulerOutput.scheduled` lists, in batch order, one `ScheduledSequence` per
request that computes tokens this step: the token ids, the position of the first
one, the request's page list (already long enough for every position computed)
and whether the step samples a token for it. The executor copies `swap_out` pages
(device -> host) before `swap_in` pages (host -> device), both before the step
runs, because a step may reuse the device pages a swap-out just vacated.

Under multi-step decoding (`scheduler.num_decode_steps`) one output is one launch of
`num_steps` decode iterations: each sequence brings its one input token and
computes `ScheduledSequence.num_steps` positions, and the executor answers with that
many tokens for it (`tokens_of`).

`Executor` is the contract on the other side: every verb the engine and the
experiments call on whatever runs the steps (`kvpage.device.executor.JaxExecutor`,
`kvpage.sim.executor.SimExecutor`, the tests' fake), declared here so that no caller
has to probe an executor for what it can do.

Nothing here is device-specific: plain ints and lists, so the same output drives a
jitted model step or a simulated GPU.
"""

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from kvpage.request import Request, TokenLogprobs

# The gateway's answers, HTTP's status codes: admitted, can never fit, queue full, cache
# pressure.
OK, BAD_REQUEST, TOO_MANY_REQUESTS, SERVICE_UNAVAILABLE = 200, 400, 429, 503


@dataclasses.dataclass(frozen=True)
class Admission:
  """The gateway's answer to one request: an HTTP-like status, why, and when to retry."""

  status: int
  reason: str = ""
  retry_after: float | None = None
  request_id: str = ""
  # Which check answered, as a stable code a gateway can send on (the `reason` is prose):
  # "admitted"; the 400s "empty_prompt", "context_length_exceeded", "exceeds_pool",
  # "invalid_token_ids", "exceeds_watermark", "exceeds_token_budget",
  # "duplicate_request_id"; the 503s "kv_pressure" and "token_budget"; the 429s
  # "rate_limited", "concurrency_limit", "queue_full", "wait_deadline" (the forecast wait
  # exceeds the request's own `max_queue_wait_s`) and "wait_forecast" (the forecast
  # time to first token exceeds the scheduler's `max_forecast_ttft_s` or its
  # `max_ttft_slowdown` x the request's idle time to first token).
  cause: str = "admitted"

  @property
  def admitted(self) -> bool:
    return self.status == OK


@dataclasses.dataclass(slots=True)
class ScheduledSequence:
  """One request's share of a step: compute `token_ids` at `start_position...`."""

  request_id: str
  token_ids: list[int]  # all_token_ids[start_position : start_position + n]; see PLACEHOLDER
  start_position: int  # = the request's num_computed_tokens before the step
  page_ids: list[int]  # the request's whole page list, covering start_position + n - 1
  samples: bool  # True iff the step ends at the sequence's last token: sample one more
  is_prefill: bool  # False only for one generated token (a decode)
  request: Request = dataclasses.field(repr=False)
  sample_index: int = 0  # tokens the request sampled before this step (its sampling key)
  # Decode iterations (multi-step decoding): the step computes positions
  # start_position ... start_position + num_steps - 1, each iteration feeding its sample
  # to the next, and samples num_steps tokens. 1 for every other sequence.
  num_steps: int = 1

  @property
  def num_tokens(self) -> int:
    return len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class Preemption:
  """A request taken out of the running set this step, and how (`mode`)."""

  request: Request
  mode: str  # "recompute", "swap" or "abort"

  @property
  def request_id(self) -> str:
    return self.request.request_id


@dataclasses.dataclass
class SchedulerOutput:
  """Everything one step needs: the batch, page copies, and what left the system."""

  step: int
  scheduled: list[ScheduledSequence] = dataclasses.field(default_factory=list)
  swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (device, host)
  swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (host, device)
  preempted: list[Preemption] = dataclasses.field(default_factory=list)
  finished: list[Request] = dataclasses.field(default_factory=list)  # since the last output
  rejected: list[Admission] = dataclasses.field(default_factory=list)  # since the last output
  num_batched_tokens: int = 0  # per iteration
  num_steps: int = 1  # iterations the launch makes room for: > 1 only for multi-step decodes

  @property
  def num_prefill_tokens(self) -> int:
    return sum(len(seq.token_ids) for seq in self.scheduled if seq.is_prefill)

  @property
  def num_decode_tokens(self) -> int:
    return sum(seq.num_steps for seq in self.scheduled if not seq.is_prefill)

  @property
  def is_empty(self) -> bool:
    """True when the step computes nothing and copies nothing."""
    return not (self.scheduled or self.swap_out or self.swap_in)


def tokens_of(sampled: int | Sequence[int]) -> list[int]:
  """An executor's answer for one sequence as a list: its token, or a multi-step
  sequence's `num_steps` tokens in order."""
  if isinstance(sampled, Sequence):
    return [int(token) for token in sampled]
  return [int(sampled)]


def make_sequence(request: Request, num_new: int) -> ScheduledSequence:
  """The next `num_new` tokens of `request`, per the token-accounting rule of request.py."""
  start = request.num_computed_tokens
  stop = start + num_new
  return ScheduledSequence(
      request.request_id, request.token_ids(start, stop), start, list(request.page_ids),
      stop == request.num_tokens, num_new > 1 or start < len(request.prompt_ids), request,
      request.num_sampled)


@dataclasses.dataclass(frozen=True)
class CostTraits:
  """What a step's cost and memory depend on beyond its shape: traits of the code that
  computes it (a device backend's, `kvpage.device.backends.traits`, or the simulated
  engine's), asked for by the simulator, the calibration and the memory plan instead
  of naming a backend.

  decode_reads_longest: every decode row of a padded step reads as far as the step's
    longest decode context, not its own (the XLA decode pass pads them to one width).
  swiglu_fused: the MLP's gate and up products never exist apart in memory, only
    `silu(gate) * up` (a kernel computes both in one call).
  decode_tokens_per_tile, prefill_query_block, prefill_tokens_per_tile: the attention
    tiles a step keeps live (keys and values gathered per decode row; a prompt chunk's
    query block against one key tile), for the memory plan's estimate; None where the
    executor has none (a simulated one).
  """

  decode_reads_longest: bool = False
  swiglu_fused: bool = False
  decode_tokens_per_tile: int | None = None
  prefill_query_block: int | None = None
  prefill_tokens_per_tile: int | None = None


# An executor's answer for one step: for each sequence that samples, its token, or for a
# multi-step decode (`SchedulerOutput.num_steps > 1`) the list of its `num_steps` tokens.
Samples = dict[str, int | list[int]]


class Executor(abc.ABC):
  """What runs the steps the scheduler plans, on a device or on a model of one.

  A step's page copies run before it, swap-outs first (`SchedulerOutput`). Steps run
  in submission order, so a step may read what an earlier, uncollected one wrote.
  The synchronous loop calls `execute`; async scheduling (`Engine(async_scheduling=
  True)`) calls `submit` for step N+1 before `collect` for step N, and collects every
  ticket it submits, once.
  """

  def execute(self, output: SchedulerOutput) -> Samples:
    """Runs the step and waits for it: `collect(submit(output))`; returns its samples."""
    return self.collect(self.submit(output))

  # Whether its steps compute logits, so `logprobs` can score the samples.
  computes_logits = False

  def logprobs(self) -> dict[str, TokenLogprobs]:
    """The log-probabilities of the last collected step's samples, for the sequences
    whose request asks for them (`SamplingParams.logprobs`). This default: none (an
    executor that computes no logits, as the simulator)."""
    return {}

  def prompt_logprobs(self) -> dict[str, list[tuple[int, TokenLogprobs]]]:
    """The last collected step's prompt log-probabilities: per request that asks
    (`SamplingParams.prompt_logprobs`), `(position, entry)` for each prompt token the
    step scored (position p: the token at p, by the logits at p - 1). This default:
    none."""
    return {}

  @abc.abstractmethod
  def submit(self, output: SchedulerOutput) -> Any:
    """Launches the step without waiting for it; returns the ticket `collect` takes."""

  @abc.abstractmethod
  def collect(self, ticket: Any) -> Samples:
    """Waits for a submitted step; returns its samples."""

  def step_shape(self, output: SchedulerOutput) -> tuple[int, int]:
    """`(tokens, sequences)` the step computes, padding included: what its cost depends
    on. This default computes the batch as scheduled, unpadded."""
    return output.num_batched_tokens, len(output.scheduled)

  def step_parts(self, step: int) -> dict[str, float] | None:
    """The priced parts of step `step`, in seconds, for executors that price their steps
    (the simulator's); None here: a real device's step is measured, not priced."""
    del step  # Unused.
    return None

  @property
  def traits(self) -> CostTraits:
    """What its steps' cost depends on beyond their shape (`CostTraits`). This default:
    each decode row reads its own context, nothing fused."""
    return CostTraits()

  @abc.abstractmethod
  def warmup(self, max_num_seqs: int, max_num_batched_tokens: int,
             all_greedy: tuple[bool, ...] = (True,), num_decode_steps: int = 1, *,
             progress: Callable[[int, int], None] | None = None,
             logprobs: bool = False) -> int:
    """Compiles every step a scheduler with these limits can launch; returns how many.
    `progress(done, total)`, if given, is called after each program; with `logprobs`,
    the programs that also score the samples and the prompt are compiled too."""

  def measure_steps(self, max_num_seqs: int,
                    max_num_batched_tokens: int) -> list[tuple[int, int, int, float]]:
    """Steps run (or priced) before any request, after `warmup`: `(tokens, context
    tokens, sequences, seconds)` each, so that the wait forecast behind retry hints and
    ETAs has prices before the first real step. This default: none."""
    del max_num_seqs, max_num_batched_tokens  # Unused.
    return []

  @property
  @abc.abstractmethod
  def num_compiles(self) -> int:
    """Programs compiled so far (0 for an executor that compiles nothing)."""
