"""The paged-attention kernels for CPU (`kvpage/device/backends/cpu/paged_attention.cc`).

XLA:CPU cannot read a page table's pages in place: `xla.py` gathers them into a fresh
buffer (a copy of every context, per layer, per step) and then reads the copy. On the
2-core VM this project is developed on, that made decode attention 2-4x slower than
PyTorch's SDPA over a contiguous cache, and prompt chunks ran at a quarter of XLA's
matmul speed. The C++ kernels read the pages where they lie, with two handlers:

  * `paged_decode`: one task per (sequence, KV head), an online softmax folded 16 keys
    at a time, the next page prefetched, for the decode rows (decode-only steps, and
    the decodes of mixed steps);
  * `paged_prefill`: one task per (sequence, KV head, query block of ~128 query rows),
    each scoring its block against key tiles of 64 tokens with register-blocked
    products, causal, for prompt chunks (fresh or over a cached prefix); at
    `Precision.HIGH` on a CPU with AMX, its products take three bf16 passes on the
    tile unit instead (`paged_prefill_bf16x3`).

The `cpu` attention implementation is the XLA paths with both kinds of row on them.
Where the kernels are not built (`kvpage.device.backends.cpu.native.status()` says why), off the CPU
backend, and for shapes the kernels do not take (`runs`), the rows stay on the XLA
paths.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvpage.device.backends.cpu import limits
from kvpage.device.backends.cpu.native import bf16x3, status

# Query heads per KV head the decode kernel takes (paged_attention.cc's kMaxGroup).
MAX_GROUP = limits.MAX_GROUP
# Head sizes both kernels are instantiated for (head_dim / 16 vectors of 16 floats).
HEAD_DIMS = limits.HEAD_DIMS


def runs(dtype: jnp.dtype, group: int, head_dim: int) -> bool:
  """Whether decode rows go through the kernel (else they stay on the XLA path): on the
  CPU backend, with the kernels built, for fp32 queries and pages, at most `MAX_GROUP`
  query heads per KV head (`group`) and a head size in `HEAD_DIMS`."""
  return group <= MAX_GROUP and prefill_runs(dtype, head_dim)


def paged_decode(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, page_tables: jax.Array,
                 limits: jax.Array, *, layer: int, sm_scale: float,
                 soft_cap: float | None = None) -> jax.Array:
  """One query token per table row, over layer `layer` of the whole cache, in place.

  Args:
    q: `f32[n, num_heads, head_dim]`, row `s` the query of table row `s`.
    k_cache, v_cache: `f32[num_layers, num_kv_heads, num_pages, page_size, head_dim]`.
    page_tables: `i32[n, max_pages]`.
    limits: `i32[n]`: row `s` sees the keys at positions below `limits[s]`; a row
      whose limit is 0 (padding, or a prompt chunk's row in a mixed step) is zeros.
    layer, sm_scale, soft_cap: static; `soft_cap` None for none.
  Returns:
    `f32[n, num_heads, head_dim]`, normalized.
  """
  if not runs(k_cache.dtype, q.shape[-2] // k_cache.shape[-4], q.shape[-1]) or (
      q.dtype != k_cache.dtype):
    raise ValueError(f"the CPU decode kernel does not run here ({status()}; backend "
                     f"{jax.default_backend()}, q {q.dtype}{list(q.shape)}, cache "
                     f"{k_cache.dtype}{list(k_cache.shape)})")
  call = jax.ffi.ffi_call("kvpage_paged_decode", jax.ShapeDtypeStruct(q.shape, jnp.float32))
  return call(q, k_cache, v_cache, page_tables.astype(jnp.int32), limits.astype(jnp.int32),
              layer=np.int64(layer), sm_scale=np.float32(sm_scale),
              soft_cap=np.float32(soft_cap or 0.0))


def prefill_runs(dtype: jnp.dtype, head_dim: int) -> bool:
  """Whether prompt chunks go through the prefill kernel (else XLA's query blocks): on
  the CPU backend, with the kernels built, fp32, a head size in `HEAD_DIMS`."""
  return (jax.default_backend() == "cpu" and jnp.dtype(dtype) == jnp.float32
          and head_dim in HEAD_DIMS and status() == "ready")


def paged_prefill(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, page_tables: jax.Array,
                  query_start_loc: jax.Array, context_lens: jax.Array, *, layer: int,
                  sm_scale: float, soft_cap: float | None = None,
                  precision: Any = None) -> jax.Array:
  """Causal attention of every prompt chunk's tokens, over layer `layer` of the whole
  cache, in place: `ragged_paged_attention` for the sequences with two or more new
  tokens; the rows of the others (decodes, padding) come out zero.

  Args:
    q: `f32[num_tokens, num_heads, head_dim]`.
    k_cache, v_cache: `f32[num_layers, num_kv_heads, num_pages, page_size, head_dim]`.
    page_tables, query_start_loc, context_lens: as in `ragged_paged_attention`.
    layer, sm_scale, soft_cap: static; `soft_cap` None for none.
    precision: the products' (`jax.lax.dot_general`'s argument): at `Precision.HIGH`
      on a CPU with AMX (`kvpage.device.backends.cpu.native.bf16x3`), and a head size that is a
      multiple of 32, the scores and the weighted values take three bf16 passes on
      the tile unit; else fp32.
  Returns:
    `f32[num_tokens, num_heads, head_dim]`, normalized.
  """
  if not prefill_runs(k_cache.dtype, q.shape[-1]) or q.dtype != k_cache.dtype:
    raise ValueError(f"the CPU prefill kernel does not run here ({status()}; backend "
                     f"{jax.default_backend()}, q {q.dtype}{list(q.shape)}, cache "
                     f"{k_cache.dtype}{list(k_cache.shape)})")
  name = ("kvpage_paged_prefill_bf16x3" if bf16x3(precision)
          and q.shape[-1] % limits.BF16X3_HEAD_DIM_MULTIPLE == 0
          else "kvpage_paged_prefill")
  call = jax.ffi.ffi_call(name, jax.ShapeDtypeStruct(q.shape, jnp.float32))
  return call(q, k_cache, v_cache, page_tables.astype(jnp.int32),
              query_start_loc.astype(jnp.int32), context_lens.astype(jnp.int32),
              layer=np.int64(layer), sm_scale=np.float32(sm_scale),
              soft_cap=np.float32(soft_cap or 0.0))
