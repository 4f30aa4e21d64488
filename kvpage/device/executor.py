"""`JaxExecutor`: the `Executor` contract over a real model and the paged cache.

The executor owns the params, the device cache, a host page pool for swapping
(`kvpage.device.cache.HostSwapPool`) and the jitted step. Swap copies run before the
step, swap-outs first (a step may reuse pages a swap-out just vacated).

`submit` launches a step and returns at once (a `Ticket`); `collect` waits for its
sampled ids; `execute` is one after the other. Under async scheduling the engine
launches step N+1 before collecting step N, so the host's work hides behind the
device's; step N+1 reads the tokens step N sampled straight from its device output
(`kvpage.device.step`). Device work runs in launch order, so a page freed on the host
while a step in flight still writes it is only reused by a later step.

`submit`, `collect` and `warmup` run under `jax.transfer_guard("disallow")`: an
implicit host<->device copy (a numpy array or Python scalar handed to a jitted
function; on an accelerator, an array read back with `np.asarray`) is an error on
the serving path, not a silent stall. The
transfers the design calls for are explicit: the step's batch (`jax.device_put` in
`kvpage.device.step`), the sampled ids (`jax.device_get`, after the copy that
`submit` starts early), and the swap copies (`HostSwapPool`). Guarding the executor,
rather than one experiment's loop, covers every real run, whoever drives the engine.
"""

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from kvpage import batch as batch_lib
from kvpage.device import cache as paged_cache
from kvpage.device import sharding
from kvpage.device.sharding import TensorParallel
from kvpage.device.step import ForwardFn, Step
from kvpage.interface import CostTraits, Executor, Samples, SchedulerOutput
from kvpage.request import MAX_LOGPROBS, TokenLogprobs

MEASURE_REPEATS = 3  # runs of each shape `measure_steps` times; the fastest is kept


def transfer_guard(level: str = "disallow") -> contextlib.AbstractContextManager[None]:
  """A context that refuses implicit host<->device transfers (`level` "disallow");
  explicit ones still run."""
  return jax.transfer_guard(level)


@dataclasses.dataclass(frozen=True)
class Ticket:
  """A launched step: its sampled ids, still on the device, and which rows sample."""

  tokens: jax.Array | None  # None: the step scheduled nothing
  info: batch_lib.BatchInfo | None
  # With a request that asks for log-probabilities: the rows' scores (`Step.
  # dispatch_logprobs`), still on the device, and each row's request's count of top ones.
  scores: jax.Array | None = None
  num_top: tuple[int | None, ...] = ()
  # With a request that asks for prompt log-probabilities: every token row's scores,
  # and which rows are whose: (request id, first row, first position, rows, top count).
  row_scores: jax.Array | None = None
  prompt_rows: tuple[tuple[str, int, int, int, int], ...] = ()
  targets: np.ndarray | None = None  # each token row's target (`batch.prompt_targets`)


class JaxExecutor(Executor):
  """A model's forward function, its params and a paged cache behind `Executor`."""

  computes_logits = True

  def __init__(self, forward: ForwardFn, params: Any, cache: paged_cache.PagedKVCache, *,
               num_host_pages: int = 0, buckets: batch_lib.Buckets | None = None,
               tensor_parallel: TensorParallel | None = None,
               param_axes: Callable[[tuple[str, ...]], Sequence[str | None]] | None = None,
               guard: str = "disallow", traits: CostTraits | None = None,
               step: Step | None = None):
    """`forward`: the model's step function (with `tensor_parallel`, the sharded
    model's); `cache`: laid out by `tensor_parallel.cache` when given; `param_axes`:
    the model's logical names of each parameter's dimensions, which place `params`
    on the mesh (`kvpage.device.sharding.param_shardings`); `guard`: the transfer
    guard's level on the serving path ("log" only where a kernel interpreter does
    implicit transfers of its own, as Mosaic GPU's on CPU does); `traits`: the model's
    backend's (`kvpage.device.backends.traits`), which `steps.jsonl` then records for a
    calibration; `step`: a jitted step to share
    with other executors over the same model and pool shape (replicas,
    `kvpage.host.replicas`), so each program compiles once for all of them and
    `num_compiles` counts theirs together (default: a new one over `forward`)."""
    self.tensor_parallel = tensor_parallel
    self._traits = traits or CostTraits()
    self.guard = guard
    # Once, explicitly: params handed over as numpy would otherwise cross to the
    # device at every step.
    if tensor_parallel is None:
      self.params = jax.device_put(params)
    else:
      if param_axes is None:
        raise ValueError("tensor parallelism needs the model's param_axes to place its weights")
      shardings = sharding.param_shardings(params, param_axes, tensor_parallel)
      # Through the host: each process places its own devices' shards.
      self.params = jax.device_put(jax.device_get(params), shardings)
    self.cache = cache
    self.buckets = buckets or batch_lib.DEFAULT_BUCKETS
    self.step = step or Step(forward, tensor_parallel=tensor_parallel)
    self.host_pool = paged_cache.HostSwapPool(
        cache, num_host_pages, None if tensor_parallel is None else tensor_parallel.cache)
    self.num_launches = 0  # steps launched (a multi-step decode is one launch)
    self._feed: jax.Array | None = None  # the last launched step's sampled ids (device)
    self._feed_rows: dict[str, int] = {}  # request -> its row in `_feed`
    self._logprobs: dict[str, TokenLogprobs] = {}  # the last collected step's
    self._prompt_logprobs: dict[str, list[tuple[int, TokenLogprobs]]] = {}  # ... and these

  @property
  def page_size(self) -> int:
    return self.cache.page_size

  @property
  def num_compiles(self) -> int:
    return self.step.num_compiles

  @property
  def traits(self) -> CostTraits:
    return self._traits

  def step_shape(self, output: SchedulerOutput) -> tuple[int, int]:
    """The batch's padded `(tokens, sequences)` (`Buckets.padded_shape`)."""
    if not output.scheduled:
      return super().step_shape(output)
    return self.buckets.padded_shape(output.num_batched_tokens, len(output.scheduled))

  def submit(self, output: SchedulerOutput) -> Ticket:
    """Runs the page copies and launches the step, without waiting for its result."""
    with transfer_guard(self.guard):
      self.host_pool.swap_out(self.cache, output.swap_out)
      self.cache = self.host_pool.swap_in(self.cache, output.swap_in)
      if not output.scheduled:
        return Ticket(None, None)
      return self._launch(output)

  def _launch(self, output: SchedulerOutput) -> Ticket:
    batch, info = batch_lib.build(output.scheduled, page_size=self.cache.page_size,
                                  buckets=self.buckets, feed_rows=self._feed_rows)
    scores = row_scores = None
    num_top: tuple[int | None, ...] = ()
    targets, prompt_rows = None, ()
    if output.num_steps == 1 and any(  # (the common case: nobody asks, nothing to build)
        seq.request.sampling.logprobs is not None
        or seq.request.sampling.prompt_logprobs is not None for seq in output.scheduled):
      num_top = tuple(seq.request.sampling.logprobs if seq.samples else None
                      for seq in output.scheduled)  # (rows follow `output.scheduled`)
      targets, prompt_rows = batch_lib.prompt_targets(output.scheduled,
                                                      batch.token_ids.shape[0])
    if output.num_steps > 1:  # multi-step decoding: samples [num_steps, feed_width]
      tokens, feed, self.cache = self.step.dispatch_multi(
          self.params, self.cache, batch, info.all_greedy, self._feed, output.num_steps)
    elif prompt_rows:  # the same pass, every token row scored too
      tokens, scores, row_scores, self.cache = self.step.dispatch_prompt_logprobs(
          self.params, self.cache, batch, info.all_greedy, self._feed, targets, MAX_LOGPROBS)
      feed = tokens
      scores, row_scores = scores.addressable_data(0), row_scores.addressable_data(0)
      scores.copy_to_host_async()
      row_scores.copy_to_host_async()
    elif any(top is not None for top in num_top):  # the same pass, scored too
      tokens, scores, self.cache = self.step.dispatch_logprobs(
          self.params, self.cache, batch, info.all_greedy, self._feed, MAX_LOGPROBS)
      feed = tokens
      scores = scores.addressable_data(0)
      scores.copy_to_host_async()
    else:
      tokens, self.cache = self.step.dispatch(self.params, self.cache, batch,
                                              info.all_greedy, self._feed)
      feed = tokens
    # The ids are whole on every device, and one process may not see them all: one copy,
    # started now, so `collect` finds them on the host.
    tokens = tokens.addressable_data(0)
    tokens.copy_to_host_async()
    self._feed = feed
    self._feed_rows = {request_id: row for row, (request_id, samples)
                       in enumerate(zip(info.request_ids, info.samples)) if samples}
    self.num_launches += 1
    return Ticket(tokens, info, scores, num_top if scores is not None else (), row_scores,
                  prompt_rows, targets)

  def collect(self, ticket: Ticket) -> Samples:
    """Waits for a launched step: a sampled token per sequence that samples (a list of
    its `num_steps` tokens for a multi-step sequence)."""
    self._logprobs, self._prompt_logprobs = {}, {}
    if ticket.tokens is None or ticket.info is None:
      return {}
    info = ticket.info
    with transfer_guard(self.guard):
      tokens = jax.device_get(ticket.tokens)
      if ticket.scores is not None:
        self._logprobs = _token_logprobs(jax.device_get(ticket.scores), tokens, ticket.num_top,
                                         info.request_ids)
      if ticket.row_scores is not None:
        self._prompt_logprobs = _row_logprobs(jax.device_get(ticket.row_scores),
                                              ticket.targets, ticket.prompt_rows)
    if tokens.ndim == 1:
      return {request_id: token for request_id, token, samples
              in zip(info.request_ids, tokens[:info.num_seqs].tolist(), info.samples)
              if samples}
    columns = tokens[:, :info.num_seqs].T.tolist()
    return {request_id: row[:num_steps] for request_id, row, num_steps
            in zip(info.request_ids, columns, info.num_steps)}

  def logprobs(self) -> dict[str, TokenLogprobs]:
    """The last collected step's log-probabilities, for the rows whose request asks."""
    return self._logprobs

  def prompt_logprobs(self) -> dict[str, list[tuple[int, TokenLogprobs]]]:
    """The last collected step's prompt log-probabilities (see `Executor`)."""
    return self._prompt_logprobs

  def warmup(self, max_num_seqs: int, max_num_batched_tokens: int,
             all_greedy: tuple[bool, ...] = (True,), num_decode_steps: int = 1, *,
             progress: Callable[[int, int], None] | None = None,
             logprobs: bool = False) -> int:
    """Compiles every step shape a scheduler with these limits can produce; returns the count.

    All-padding batches write only the null page, so the cache's contents are untouched.
    With pinned buckets (`Buckets.for_server`) this is a few programs per token bucket,
    and serving never compiles on the request path afterwards. With
    `num_decode_steps > 1` every decode shape also gets its multi-step program; with
    `logprobs`, its two scoring programs (`Step.dispatch_logprobs`,
    `dispatch_prompt_logprobs`), else they compile when a request first asks.
    """
    shapes = self.buckets.warmup_shapes(max_num_seqs, max_num_batched_tokens)
    width = self.buckets.table_width(1)
    multi = num_decode_steps > 1
    scored = 2 if logprobs else 0  # the programs that score the samples, and the prompt
    total = sum((1 + (multi and decode_only) + scored) * len(all_greedy)
                for _, _, decode_only in shapes)
    count = 0
    with transfer_guard(self.guard):
      for num_tokens, num_seqs, decode_only in shapes:
        batch = batch_lib.example_batch(num_tokens, num_seqs, width, decode_only=decode_only)
        for greedy in all_greedy:  # fed like serving steps, so their programs match
          self._feed, self.cache = self.step.dispatch(self.params, self.cache, batch, greedy,
                                                      self._feed)
          count += 1
          if progress is not None:
            progress(count, total)
          if decode_only and multi:
            _, self._feed, self.cache = self.step.dispatch_multi(
                self.params, self.cache, batch, greedy, self._feed, num_decode_steps)
            count += 1
            if progress is not None:
              progress(count, total)
          if logprobs:  # (all padding: nothing is scored that a request reads)
            self._feed, _, self.cache = self.step.dispatch_logprobs(
                self.params, self.cache, batch, greedy, self._feed, MAX_LOGPROBS)
            targets = np.full(num_tokens, -1, np.int32)
            self._feed, _, _, self.cache = self.step.dispatch_prompt_logprobs(
                self.params, self.cache, batch, greedy, self._feed, targets, MAX_LOGPROBS)
            count += 2
            if progress is not None:
              progress(count, total)
      if self._feed is not None:
        self._feed.block_until_ready()
    return count

  def measure_steps(self, max_num_seqs: int,
                    max_num_batched_tokens: int) -> list[tuple[int, int, int, float]]:
    """Each warm-up shape (greedy) timed, the faster of `MEASURE_REPEATS` runs: all
    padding, so no context is read (the real steps' samples bring the KV reads in)."""
    width = self.buckets.table_width(1)
    measured = []
    with transfer_guard(self.guard):
      for num_tokens, num_seqs, decode_only in self.buckets.warmup_shapes(
          max_num_seqs, max_num_batched_tokens):
        batch = batch_lib.example_batch(num_tokens, num_seqs, width, decode_only=decode_only)
        best = math.inf
        for _ in range(MEASURE_REPEATS):
          start = time.perf_counter()
          self._feed, self.cache = self.step.dispatch(self.params, self.cache, batch, True,
                                                      self._feed)
          self._feed.block_until_ready()
          best = min(best, time.perf_counter() - start)
        measured.append((num_tokens, 0, num_seqs, best))
    return measured


def _entry(values: np.ndarray, token_id: int, top: int) -> TokenLogprobs:
  """One row of packed scores (`kvpage.device.step._pack_scores`) as `token_id`'s entry,
  with its request's count of the likeliest."""
  ids = values[1 + MAX_LOGPROBS:].astype(np.int64)
  return TokenLogprobs(token_id, float(values[0]), tuple(
      (int(i), float(v)) for i, v in zip(ids[:top], values[1:1 + top])))


def _token_logprobs(scores: np.ndarray, tokens: np.ndarray, num_top: Sequence[int | None],
                    request_ids: Sequence[str]) -> dict[str, TokenLogprobs]:
  """Rows of `Step.dispatch_logprobs`' scores, for the requests that ask: the sampled
  token's entry."""
  return {request_id: _entry(scores[row], int(tokens[row]), top)
          for row, (request_id, top) in enumerate(zip(request_ids, num_top))
          if top is not None}


def _row_logprobs(scores: np.ndarray, targets: np.ndarray,
                  owners: Sequence[tuple[str, int, int, int, int]]
                  ) -> dict[str, list[tuple[int, TokenLogprobs]]]:
  """Token rows' scores (`Step.dispatch_prompt_logprobs`) for their owners: position p
  + 1's token (row p's target) scored by row p's logits."""
  return {request_id: [(first_position + i + 1,
                        _entry(scores[first_row + i], int(targets[first_row + i]), top))
                       for i in range(count)]
          for request_id, first_row, first_position, count, top in owners}
