"""Paged attention: one entry point over an oracle, the XLA paths and the Pallas kernels.

Every implementation computes the same thing, causal attention of a ragged batch of
new tokens over a paged KV cache (the contract is written out in `reference.py`):

  * `reference.py`: the oracle, `ragged_paged_attention`, written for clarity; with the
    input checks, the token layout and the online-softmax update the others share.
  * `xla.py`: the paths serving runs on XLA, `paged_decode_attention` for decode-only
    steps and `ragged_blocked_attention` (by query blocks) for any step; both read one
    layer straight out of the whole cache.
  * `cpu.py`: C++ kernels (XLA FFI, built from `kvpage/device/cpu/`) that read pages
    in place; the `cpu` implementation is the XLA paths with their decode rows and
    prompt chunks on them where they run (the CPU backend, fp32, the kernels built),
    and the plain XLA paths elsewhere.
  * `pallas/`: the GPU kernels (Flash-Decoding, and query blocks for mixed steps),
    behind one entry, `pallas.ragged_paged_attention`; `mosaic` is the same entry with
    the Mosaic GPU decode kernel (`pallas/mosaic_decode.py`, jax >= 0.11.2) for
    decode-only steps, Triton for mixed ones, until a GPU measures both.

A model calls only `attention(impl, ...)`, with the whole cache and its layer, so the
choice among implementations and their calling conventions lives here.
"""

from typing import Any

import jax

from kvpage.device import sharding
from kvpage.device.attention import cpu, reference, xla
from kvpage.device.sharding import TensorParallel

ATTENTION_IMPLS = ("xla", "cpu", "reference", "pallas", "mosaic")


def attention(impl: str, q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, *, layer: int,
              page_tables: jax.Array, context_lens: jax.Array, query_start_loc: jax.Array,
              decode_only: bool, tensor_parallel: TensorParallel | None = None,
              precision: Any = None) -> jax.Array:
  """One layer's attention of a step's new tokens, by the implementation `impl`.

  Args:
    impl: one of `ATTENTION_IMPLS`: `xla` (the fast XLA paths), `cpu` (the same with
      decode rows on the C++ kernel where it runs, `cpu.runs`), `reference` (the oracle),
      `pallas` (the Triton kernels) or `mosaic` (the Mosaic GPU decode kernel); the
      GPU kernels are interpreted when JAX's backend is the CPU.
    q: `[num_tokens, num_heads, head_dim]`, in the cache's dtype.
    k_pages, v_pages: the whole cache, `[num_layers, num_kv_heads, num_pages,
      page_size, head_dim]`; `xla` reads layer `layer` in place, the others a slice.
    layer: the layer to attend over (static).
    page_tables, context_lens, query_start_loc: as in `reference.ragged_paged_attention`.
    decode_only: a static Python bool: every sequence brings exactly one new token,
      token `s` being sequence `s`'s. `xla` then takes its decode-only path.
    tensor_parallel: the mesh the step runs on, if any: `q` split by query heads and
      the pools by KV heads (`kvpage.device.sharding`); each device attends with its own.
    precision: the products' (`jax.lax.dot_general`'s argument); `cpu` takes prompt
      chunks' products in three bf16 passes on AMX at `Precision.HIGH`
      (`cpu.paged_prefill`), the others keep their own.
  Returns:
    `[num_tokens, num_heads, head_dim]` in `q.dtype`.
  Raises:
    ValueError: `impl` is not one of `ATTENTION_IMPLS`.
  """
  if not isinstance(decode_only, bool):
    # A traced flag cannot pick a code path at trace time; the batch's type carries it.
    raise TypeError(f"decode_only must be a static Python bool, got {type(decode_only)}")
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"unknown attention impl {impl!r}; choose one of: "
                     f"{', '.join(ATTENTION_IMPLS)}")
  def one_device(q, k_pages, v_pages, page_tables, context_lens, query_start_loc):
    return _attention(impl, q, k_pages, v_pages, layer=layer, page_tables=page_tables,
                      context_lens=context_lens, query_start_loc=query_start_loc,
                      decode_only=decode_only, precision=precision)
  if tensor_parallel is not None:
    one_device = sharding.shard_attention(one_device, tensor_parallel)
  return one_device(q, k_pages, v_pages, page_tables, context_lens, query_start_loc)


def decode_reads_longest(impl: str, *, kv_dtype: Any, num_heads: int, num_kv_heads: int,
                         head_dim: int) -> bool:
  """Whether `impl`'s decode rows each read as far as the step's longest decode context
  (the XLA decode pass pads them so), rather than their own: what a step-time
  calibration must know (`kvpage.sim.calibration`)."""
  if impl == "cpu":
    return not cpu.runs(kv_dtype, num_heads // num_kv_heads, head_dim)
  return impl == "xla"


def _attention(impl, q, k_pages, v_pages, *, layer, page_tables, context_lens, query_start_loc,
               decode_only, precision):
  lengths = dict(page_tables=page_tables, context_lens=context_lens)
  if impl in ("xla", "cpu") and decode_only:
    return xla.paged_decode_attention(q, k_pages, v_pages, layer=layer, **lengths,
                                      decode_kernel=impl)
  if impl in ("xla", "cpu"):
    return xla.ragged_blocked_attention(q, k_pages, v_pages, layer=layer, **lengths,
                                        query_start_loc=query_start_loc, decode_kernel=impl,
                                        precision=precision)
  if impl == "reference":
    return reference.ragged_paged_attention(q, k_pages[layer], v_pages[layer], **lengths,
                                            query_start_loc=query_start_loc)
  if impl in ("pallas", "mosaic"):
    from kvpage.device.attention import pallas  # Imported only when chosen.

    return pallas.ragged_paged_attention(q, k_pages[layer], v_pages[layer], **lengths,
                                         query_start_loc=query_start_loc,
                                         interpret=jax.default_backend() == "cpu",
                                         decode_kernel="mosaic" if impl == "mosaic"
                                         else "triton")
  raise AssertionError(impl)
