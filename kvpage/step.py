"""The jitted step: one ragged mixed batch through the model, sampled ids back to the host.

`Step` wraps a model's forward function `(params, cache, batch) -> (logits, cache)`
(kvpage never imports a model: experiments pass one in) and jits it once, at the
boundary: the cache is donated so XLA updates the page pool in place, the batch
arrives already padded to buckets so shapes repeat, and the only static argument is
whether the sampler can be skipped. The sampled ids come back in one device-to-host
transfer. `num_compiles` counts traces, so tests and benchmarks can assert that
steady-state serving never recompiles.
"""

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from kvpage import paged_cache, sampling
from kvpage.batch import StepBatch

ForwardFn = Callable[[Any, paged_cache.PagedKVCache, StepBatch],
                     tuple[jax.Array, paged_cache.PagedKVCache]]


class Step:
  """`step(params, cache, batch, all_greedy) -> (np.ndarray token ids, new cache)`."""

  def __init__(self, forward: ForwardFn):
    self.forward = forward
    self.num_compiles = 0
    self._jitted = jax.jit(self._step, donate_argnums=(1,), static_argnames=("all_greedy",))

  def _step(self, params, cache, batch, all_greedy):
    self.num_compiles += 1  # Python side effect: runs once per trace, i.e. per compile.
    logits, cache = self.forward(params, cache, batch)
    return sampling.sample(logits, batch, all_greedy=all_greedy), cache

  def __call__(self, params: Any, cache: paged_cache.PagedKVCache, batch: StepBatch,
               all_greedy: bool) -> tuple[np.ndarray, paged_cache.PagedKVCache]:
    tokens, cache = self._jitted(params, cache, batch, all_greedy=all_greedy)
    return np.asarray(jax.device_get(tokens)), cache
