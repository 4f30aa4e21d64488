"""The XLA backend: every op in plain JAX, compiled by XLA for whatever device runs it.

It is the floor the other backends stand on: each runs on any JAX backend, so a model
compiles everywhere, and another backend hands back to it whatever its kernels do not
take (a shape, a dtype, a device).

  * attention: the paths in `attention.py` (a decode-only path, and query blocks for
    mixed steps), which read one layer straight out of the whole cache;
  * products: `jax.lax.dot_general` at the run's precision, RMSNorm and the residual
    add as XLA passes of their own (`Linear`);
  * its cost traits (`traits`): every decode row of a step reads as far as the step's
    longest decode context (the decode pass pads them to one width), and the attention
    tiles that bound a step's temporaries (the memory plan's estimate).
"""

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from kvpage.device import sharding
from kvpage.device.backends.xla import attention as paths
from kvpage.device.backends.xla.attention import NO_KERNELS, RowKernels
from kvpage.device.sharding import TensorParallel
from kvpage.interface import CostTraits


def attend(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, *, layer: int,
              page_tables: jax.Array, context_lens: jax.Array, query_start_loc: jax.Array,
              decode_only: bool, precision: Any = None,
              kernels: RowKernels = NO_KERNELS) -> jax.Array:
  """One layer's attention on one device (`kvpage.device.backends.Ops.attention`): the
  decode-only path when the step says so, else query blocks; `kernels` take over the
  rows they compute. The XLA paths keep their own precision."""
  del precision  # fp32 throughout
  lengths = dict(page_tables=page_tables, context_lens=context_lens)
  if decode_only:
    return paths.paged_decode_attention(q, k_pages, v_pages, layer=layer, **lengths,
                                        kernels=kernels)
  return paths.ragged_blocked_attention(q, k_pages, v_pages, layer=layer, **lengths,
                                        query_start_loc=query_start_loc, kernels=kernels)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """Llama's RMSNorm, computed in fp32 and scaled in `x`'s dtype."""
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return scale * normed.astype(x.dtype)


def matmul(x: jax.Array, w: jax.Array, precision: Any) -> jax.Array:
  """`x @ w` for `x` [..., K] and `w` [K, N], at `precision`."""
  return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)


class Linear:
  """A layer's products on XLA at `precision`. Under `tensor_parallel`, XLA's
  partitioner splits them over the devices (Megatron's split, `kvpage.device.sharding`)
  and all-reduces a row-parallel result before its residual is added."""

  def __init__(self, precision: Any, tensor_parallel: TensorParallel | None = None):
    self.precision = precision
    self.tensor_parallel = tensor_parallel

  def project(self, x: jax.Array, weights: Sequence[jax.Array], *,
              norm: tuple[jax.Array, float] | None = None,
              residual: jax.Array | None = None) -> list[jax.Array]:
    """`[x @ w for w in weights]`; with `norm` (scale, eps), of `rms_norm(x)`; with
    `residual`, plus the one result made whole across devices."""
    if norm is not None:
      x = rms_norm(x, *norm)
    outs = [matmul(x, w, self.precision) for w in weights]
    if residual is not None:
      outs = [residual + sharding.constrain(outs[0], self.tensor_parallel, "replicated")]
    return outs

  def swiglu(self, x: jax.Array, gate: jax.Array, up: jax.Array, *,
             norm: tuple[jax.Array, float] | None = None) -> jax.Array:
    """`silu(x @ gate) * (x @ up)`, of `rms_norm(x)` with `norm`."""
    gate_out, up_out = self.project(x, [gate, up], norm=norm)
    return jax.nn.silu(gate_out) * up_out


def traits(*, decode_reads_longest: bool = True, swiglu_fused: bool = False) -> CostTraits:
  """The XLA paths' cost traits; a backend built on them (`cpu`) says which rows and
  products its kernels take instead."""
  return CostTraits(decode_reads_longest=decode_reads_longest, swiglu_fused=swiglu_fused,
                    decode_tokens_per_tile=paths.DECODE_TOKENS_PER_TILE,
                    prefill_query_block=paths.PREFILL_QUERY_BLOCK,
                    prefill_tokens_per_tile=paths.PREFILL_TOKENS_PER_TILE)
