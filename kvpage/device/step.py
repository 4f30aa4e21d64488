"""The jitted step: one ragged mixed batch through the model, sampled ids back to the host.

`Step` wraps a model's forward function `(params, cache, batch) -> (logits, cache)`
(kvpage never imports a model: `kvpage.build` is handed one) and jits it once, at the
boundary: the cache is donated so XLA updates the page pool in place, the batch
arrives already padded to buckets so shapes repeat, and the only static argument is
whether the sampler can be skipped. `num_compiles` counts traces (a new shape or
static flag), so tests and benchmarks can assert that steady-state serving never
recompiles; it cannot see a compilation that reuses a trace (e.g. an input that
differs only in being committed to a device), which the tests catch by counting XLA
compilations through `jax.monitoring`.

The batch arrives as numpy and crosses to the device in one explicit `jax.device_put`
per launch, packed into one buffer (`batch.pack`), never as an implicit transfer at the
jit boundary, which a transfer guard would refuse. The sampled ids leave as one fixed-
width device array (`feed_width`, padded), which is also the `feed` of the next step: a
batch token id `-(r + 1)` is read from row `r` of it on the device (async scheduling,
`kvpage.batch`). `dispatch` returns without waiting for the device; the executor fetches
the ids.

Under tensor parallelism (`tensor_parallel`, `kvpage.device.sharding`) the forward
function is the sharded model's; the step places the batch and the feed whole on
every device of the mesh and pins the outputs' layouts (ids whole, the cache split by
KV heads as it came in), so the donated cache keeps its layout from step to step.

`dispatch_logprobs` is `dispatch` that also returns, for each sampled row, the float32
log-softmax of its logits at the sampled token and the `num_logprobs` likeliest tokens
(`jax.lax.top_k`): the same forward pass, a program of its own compiled when first
asked for.

`dispatch_multi` runs multi-step decoding (`scheduler.num_decode_steps`): a decode
batch goes through up to `num_steps` iterations in one program (a `fori_loop` over
the model), each iteration's samples becoming the next one's tokens on the device.
Launch cost and host work are paid once per launch instead of once per token.
"""

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvpage import batch as batch_lib
from kvpage import units
from kvpage.batch import StepBatch
from kvpage.device import cache as paged_cache
from kvpage.device import sampling
from kvpage.device.sharding import TensorParallel

ForwardFn = Callable[[Any, paged_cache.PagedKVCache, StepBatch],
                     tuple[jax.Array, paged_cache.PagedKVCache]]


def _unpack(packed: jax.Array, layout: batch_lib.BatchLayout) -> StepBatch:
  """`batch_lib.pack` undone inside the program: slices of one buffer, floats bitcast."""
  fields, offset = [], 0
  for name, shape in zip(StepBatch._fields, layout.shapes, strict=True):
    size = math.prod(shape)
    flat = packed[offset:offset + size]
    dtype = batch_lib.field_dtype(name)
    if dtype is not np.int32:
      flat = jax.lax.bitcast_convert_type(flat, dtype)
    fields.append(flat.reshape(shape))
    offset += size
  return layout.batch_type(*fields)


def _fed_tokens(batch: StepBatch, feed: jax.Array) -> jax.Array:
  """The batch's token ids, each `-(r + 1)` replaced by row `r` of the previous launch's feed."""
  fed = feed[jnp.maximum(-1 - batch.token_ids, 0)]
  return jnp.where(batch.token_ids < 0, fed, batch.token_ids)


def _pack_scores(scores: jax.Array, chosen: jax.Array, num_logprobs: int) -> jax.Array:
  """Per row of log-probabilities `scores`: the `chosen` token's, the `num_logprobs`
  likeliest, and their ids (as float32: exact below 2^24), `f32[rows, 1 + 2 * k]`."""
  picked = jnp.take_along_axis(scores, chosen[:, None], axis=1)
  top_scores, top_ids = jax.lax.top_k(scores, num_logprobs)
  return jnp.concatenate([picked, top_scores, top_ids.astype(jnp.float32)], axis=1)


class Step:
  """A model's forward function and the sampler, jitted: `dispatch`, `dispatch_multi`."""

  def __init__(self, forward: ForwardFn, feed_width: int = batch_lib.SEQ_BUCKETS[-1],
               tensor_parallel: TensorParallel | None = None):
    self.forward = forward
    self.num_compiles = 0
    self.feed_width = feed_width
    tp = tensor_parallel
    # Inputs the host sends: whole on every device of the mesh (default device without).
    self._whole = None if tp is None else tp.replicated
    single = {} if tp is None else dict(out_shardings=(tp.replicated, tp.cache))
    multi = {} if tp is None else dict(out_shardings=(tp.replicated, tp.replicated, tp.cache))
    self._jitted = jax.jit(self._step, donate_argnums=(1,),
                           static_argnames=("layout", "all_greedy"), **single)
    self._jitted_multi = jax.jit(self._multi_step, donate_argnums=(1,),
                                 static_argnames=("layout", "all_greedy", "num_steps"), **multi)
    scored = {} if tp is None else dict(out_shardings=(tp.replicated, tp.replicated, tp.cache))
    self._jitted_logprobs = jax.jit(self._step_logprobs, donate_argnums=(1,),
                                    static_argnames=("layout", "all_greedy", "num_logprobs"),
                                    **scored)
    prompted = {} if tp is None else dict(
        out_shardings=(tp.replicated, tp.replicated, tp.replicated, tp.cache))
    self._jitted_prompt_logprobs = jax.jit(
        self._step_prompt_logprobs, donate_argnums=(1,),
        static_argnames=("layout", "all_greedy", "num_logprobs"), **prompted)
    self._no_feed = None

  def _step(self, params, cache, packed, feed, layout, all_greedy):
    self.num_compiles += 1  # Python side effect: runs once per trace, i.e. per compile.
    batch = _unpack(packed, layout)
    batch = batch._replace(token_ids=_fed_tokens(batch, feed))
    logits, cache = self.forward(params, cache, batch)
    tokens = sampling.sample(logits, batch, all_greedy=all_greedy)
    return jnp.zeros_like(feed).at[:tokens.shape[0]].set(tokens), cache

  def _step_logprobs(self, params, cache, packed, feed, layout, all_greedy, num_logprobs):
    """`_step`, and each sampled row's log-probabilities: `f32[rows, 1 + num_logprobs]`
    (the sampled token's, then the likeliest tokens') and `i32[rows, num_logprobs]` (the
    likeliest tokens' ids), packed as one f32 array `[rows, 1 + 2 * num_logprobs]`."""
    self.num_compiles += 1
    batch = _unpack(packed, layout)
    batch = batch._replace(token_ids=_fed_tokens(batch, feed))
    logits, cache = self.forward(params, cache, batch)
    tokens = sampling.sample(logits, batch, all_greedy=all_greedy)
    scores = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return (jnp.zeros_like(feed).at[:tokens.shape[0]].set(tokens),
            _pack_scores(scores, tokens, num_logprobs), cache)

  def _step_prompt_logprobs(self, params, cache, packed, feed, targets, layout, all_greedy,
                            num_logprobs):
    """`_step_logprobs`, and every token row scored against `targets` (the prompt token
    that follows it; -1: none): the model's logits at all rows, not only the sampled
    ones, from the same forward pass. Returns the ids, the sampled rows' scores and the
    token rows' scores, both packed as `_step_logprobs` packs them."""
    self.num_compiles += 1
    batch = _unpack(packed, layout)
    batch = batch._replace(token_ids=_fed_tokens(batch, feed))
    rows = batch.token_ids.shape[0]
    every_row = batch._replace(logits_indices=jnp.arange(rows, dtype=jnp.int32))
    logits_all, cache = self.forward(params, cache, every_row)
    scores_all = jax.nn.log_softmax(logits_all.astype(jnp.float32), axis=-1)
    logits = logits_all[batch.logits_indices]
    tokens = sampling.sample(logits, batch, all_greedy=all_greedy)
    sampled = _pack_scores(scores_all[batch.logits_indices], tokens, num_logprobs)
    prompt = _pack_scores(scores_all, jnp.maximum(targets, 0), num_logprobs)
    return (jnp.zeros_like(feed).at[:tokens.shape[0]].set(tokens), sampled, prompt, cache)

  def _multi_step(self, params, cache, packed, feed, layout, all_greedy, num_steps):
    """Up to `num_steps` decode iterations in one program; row s runs `batch.num_steps[s]`.

    Iteration i moves each live row one position on (its pages were reserved by the
    scheduler), recomputes its slot from the page table, and feeds the previous
    iteration's sample as its token. A row past its own count stays put and writes
    the null page; its samples are ignored. Returns every iteration's samples,
    `i32[num_steps, feed_width]`, and the feed for the next launch: each row's last.
    """
    self.num_compiles += 1
    batch = _unpack(packed, layout)
    first_tokens = _fed_tokens(batch, feed)
    num_tokens, num_seqs = batch.token_ids.shape[0], batch.context_lens.shape[0]
    page_size = cache.page_size
    # Decode batch: token row s < num_seqs is sequence s's; rows past them are padding.
    row_steps = jnp.zeros(num_tokens, jnp.int32).at[:num_seqs].set(batch.num_steps)
    row_tables = batch.page_tables[jnp.minimum(jnp.arange(num_tokens), num_seqs - 1)]
    samples = jnp.zeros((num_steps, self.feed_width), jnp.int32)

    def iteration(i, carry):
      cache, tokens, samples = carry
      advance = jnp.minimum(i, jnp.maximum(row_steps - 1, 0))
      positions = batch.positions + advance
      pages = jnp.take_along_axis(row_tables, (positions // page_size)[:, None], 1)[:, 0]
      live = i < row_steps
      slots = jnp.where(live, pages * page_size + positions % page_size,
                        units.NULL_PAGE * page_size)
      step_batch = batch._replace(
          token_ids=tokens, positions=positions, slot_mapping=slots,
          context_lens=batch.context_lens + advance[:num_seqs],
          sample_index=batch.sample_index + i)
      logits, cache = self.forward(params, cache, step_batch)
      sampled = sampling.sample(logits, step_batch, all_greedy=all_greedy)
      return (cache, tokens.at[:num_seqs].set(sampled),
              samples.at[i, :num_seqs].set(sampled))

    cache, _, samples = jax.lax.fori_loop(0, jnp.max(batch.num_steps), iteration,
                                          (cache, first_tokens, samples))
    last = samples[jnp.maximum(batch.num_steps - 1, 0), jnp.arange(num_seqs)]
    return samples, jnp.zeros_like(feed).at[:num_seqs].set(last), cache

  def temp_bytes(self, params: Any, cache: paged_cache.PagedKVCache, batch: StepBatch,
                 all_greedy: bool) -> int:
    """Bytes of temporaries XLA's buffer assignment gives this batch's step program: the
    activations it needs beside its arguments. Compiles the program and runs nothing;
    `params` and `cache` may be `jax.ShapeDtypeStruct`s (nothing is allocated)."""
    packed, layout = batch_lib.pack(batch)
    feed = np.zeros(self.feed_width, np.int32)
    if self._whole is not None:  # shapes laid out as the step's real inputs are
      packed, feed = (jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._whole)
                      for x in (packed, feed))
    compiled = self._jitted.lower(params, cache, packed, feed,
                                  layout=layout, all_greedy=all_greedy).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)

  def empty_feed(self) -> jax.Array:
    """An all-zero feed, for a step whose batch has no token in flight.

    Uncommitted, like the step's own outputs: jit keys its cache on committedness,
    so a committed feed would compile every program a second time.
    """
    if self._no_feed is None:
      self._no_feed = jax.device_put(np.zeros(self.feed_width, np.int32), self._whole)
    return self._no_feed

  def _checked_feed(self, batch: StepBatch, feed: jax.Array | None) -> jax.Array:
    num_seqs = batch.context_lens.shape[0]
    if num_seqs > self.feed_width:
      raise ValueError(f"a batch of {num_seqs} sequences exceeds the step's feed width "
                       f"{self.feed_width}")
    return self.empty_feed() if feed is None else feed

  def dispatch(self, params: Any, cache: paged_cache.PagedKVCache, batch: StepBatch,
               all_greedy: bool, feed: jax.Array | None = None
               ) -> tuple[jax.Array, paged_cache.PagedKVCache]:
    """Launches the step; returns `i32[feed_width]` sampled ids (row s: sequence s) at once."""
    feed = self._checked_feed(batch, feed)
    packed, layout = batch_lib.pack(batch)
    return self._jitted(params, cache, jax.device_put(packed, self._whole), feed,
                        layout=layout, all_greedy=all_greedy)

  def dispatch_logprobs(self, params: Any, cache: paged_cache.PagedKVCache, batch: StepBatch,
                        all_greedy: bool, feed: jax.Array | None, num_logprobs: int
                        ) -> tuple[jax.Array, jax.Array, paged_cache.PagedKVCache]:
    """`dispatch`, plus each sampled row's log-probabilities: returns `(ids, scores,
    cache)` at once, `scores` `f32[rows, 1 + 2 * num_logprobs]` as `_step_logprobs`
    packs them (token ids below 2^24 are exact in float32)."""
    feed = self._checked_feed(batch, feed)
    packed, layout = batch_lib.pack(batch)
    return self._jitted_logprobs(params, cache, jax.device_put(packed, self._whole), feed,
                                 layout=layout, all_greedy=all_greedy,
                                 num_logprobs=num_logprobs)

  def dispatch_prompt_logprobs(self, params: Any, cache: paged_cache.PagedKVCache,
                               batch: StepBatch, all_greedy: bool, feed: jax.Array | None,
                               targets: np.ndarray, num_logprobs: int
                               ) -> tuple[jax.Array, jax.Array, jax.Array,
                                          paged_cache.PagedKVCache]:
    """`dispatch_logprobs`, and each token row's score against `targets` (`i32[rows]`,
    the batch's padded token count): returns `(ids, sampled scores, row scores, cache)`
    at once."""
    feed = self._checked_feed(batch, feed)
    packed, layout = batch_lib.pack(batch)
    return self._jitted_prompt_logprobs(
        params, cache, jax.device_put(packed, self._whole), feed,
        jax.device_put(targets, self._whole), layout=layout, all_greedy=all_greedy,
        num_logprobs=num_logprobs)

  def dispatch_multi(self, params: Any, cache: paged_cache.PagedKVCache, batch: StepBatch,
                     all_greedy: bool, feed: jax.Array | None, num_steps: int
                     ) -> tuple[jax.Array, jax.Array, paged_cache.PagedKVCache]:
    """Launches a multi-step decode (`batch` decode-only, `batch.num_steps` each row's
    iterations, at most `num_steps`); returns `(samples i32[num_steps, feed_width],
    feed i32[feed_width], cache)` at once, the feed holding each row's last sample."""
    if not batch.decode_only:
      raise ValueError("multi-step decoding needs a decode-only batch")
    feed = self._checked_feed(batch, feed)
    packed, layout = batch_lib.pack(batch)
    return self._jitted_multi(params, cache, jax.device_put(packed, self._whole), feed,
                              layout=layout, all_greedy=all_greedy, num_steps=num_steps)
