"""The jitted step: one ragged mixed batch through the model, sampled ids back to the host.

`Step` wraps a model's forward function `(params, cache, batch) -> (logits, cache)`
(kvpage never imports a model: experiments pass one in) and jits it once, at the
boundary: the cache is donated so XLA updates the page pool in place, the batch
arrives already padded to buckets so shapes repeat, and the only static argument is
whether the sampler can be skipped. `num_compiles` counts traces (a new shape or
static flag), so tests and benchmarks can assert that steady-state serving never
recompiles; it cannot see a compilation that reuses a trace (e.g. an input that
differs only in being committed to a device), which the tests catch by counting XLA
compilations through `jax.monitoring`.

The sampled ids leave as one fixed-width device array (`feed_width`, padded), which
is also the `feed` of the next step: a batch token id `-(r + 1)` is read from row `r`
of it on the device (async scheduling, `kvpage.batch`). `dispatch` returns without
waiting for the device; `__call__` waits and returns the ids as numpy, in one
device-to-host transfer.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvpage import batch as batch_lib
from kvpage import paged_cache, sampling
from kvpage.batch import StepBatch

ForwardFn = Callable[[Any, paged_cache.PagedKVCache, StepBatch],
                     tuple[jax.Array, paged_cache.PagedKVCache]]


class Step:
  """`step(params, cache, batch, all_greedy) -> (np.ndarray token ids, new cache)`."""

  def __init__(self, forward: ForwardFn, feed_width: int = batch_lib.SEQ_BUCKETS[-1]):
    self.forward = forward
    self.num_compiles = 0
    self.feed_width = feed_width
    self._jitted = jax.jit(self._step, donate_argnums=(1,), static_argnames=("all_greedy",))
    self._no_feed = None

  def _step(self, params, cache, batch, feed, all_greedy):
    self.num_compiles += 1  # Python side effect: runs once per trace, i.e. per compile.
    fed = feed[jnp.maximum(-1 - batch.token_ids, 0)]
    batch = batch._replace(token_ids=jnp.where(batch.token_ids < 0, fed, batch.token_ids))
    logits, cache = self.forward(params, cache, batch)
    tokens = sampling.sample(logits, batch, all_greedy=all_greedy)
    return jnp.zeros_like(feed).at[:tokens.shape[0]].set(tokens), cache

  def empty_feed(self) -> jax.Array:
    """An all-zero feed, for a step whose batch has no token in flight.

    Uncommitted, like the step's own outputs: jit keys its cache on committedness,
    so a committed feed would compile every program a second time.
    """
    if self._no_feed is None:
      self._no_feed = jnp.zeros(self.feed_width, jnp.int32)
    return self._no_feed

  def dispatch(self, params: Any, cache: paged_cache.PagedKVCache, batch: StepBatch,
               all_greedy: bool, feed: jax.Array | None = None
               ) -> tuple[jax.Array, paged_cache.PagedKVCache]:
    """Launches the step; returns `i32[feed_width]` sampled ids (row s: sequence s) at once."""
    num_seqs = batch.context_lens.shape[0]
    if num_seqs > self.feed_width:
      raise ValueError(f"a batch of {num_seqs} sequences exceeds the step's feed width "
                       f"{self.feed_width}")
    feed = self.empty_feed() if feed is None else feed
    return self._jitted(params, cache, batch, feed, all_greedy=all_greedy)

  def __call__(self, params: Any, cache: paged_cache.PagedKVCache, batch: StepBatch,
               all_greedy: bool, feed: jax.Array | None = None
               ) -> tuple[np.ndarray, paged_cache.PagedKVCache]:
    tokens, cache = self.dispatch(params, cache, batch, all_greedy, feed)
    return np.asarray(tokens)[:batch.context_lens.shape[0]], cache
