"""The Pallas kernels' entry point: `ragged_paged_attention`, with the oracle's contract.

It has the contract of `reference.ragged_paged_attention` plus `interpret=`, and is
what the `pallas` and `mosaic` run choices call (`kvpage.device.backends.pallas.attend`,
on one layer's pages, interpreted on CPU). It picks one of two Pallas kernels:

  * every sequence has (at most) one new token -> `decode.paged_decode_attention`, the
    Flash-Decoding kernel that reads each KV page once per KV head (Triton), or with
    `decode_kernel="mosaic"` its Mosaic GPU twin, `mosaic_decode.paged_decode_attention`;
  * otherwise (prefill, chunked prefill, mixed batches) -> `ragged.ragged_mixed_attention`,
    by query blocks.

With concrete arguments the choice is made in Python; under `jit` (the serving step,
where lengths are traced) it is a `lax.cond`, so one compiled step serves both kinds
of batch without retracing. A decode batch's new tokens may sit anywhere in `q` (the
host pads token counts and sequence counts to separate buckets), so the decode path
gathers each sequence's row by `query_start_loc` and scatters the result back;
padding rows stay zero, as in the reference.

Each kernel module reads kernel body, `pallas_call` wrapper, then jitted API; the
tests (`tests/test_kernels.py`) check all three against the one oracle,
`reference.ragged_paged_attention`, rather than a per-kernel copy of it.
"""

import jax
import jax.numpy as jnp

from kvpage.device.attention import reference
from kvpage.device.backends.pallas import decode, ragged

DECODE_KERNELS = ("triton", "mosaic")


def _decode_rows(q, k_pages, v_pages, page_tables, context_lens, query_start_loc, *,
                 sm_scale, soft_cap, interpret, decode_kernel):
  """Runs the decode kernel on the one new row of each sequence, in place in `q`'s rows."""
  num_tokens = q.shape[0]
  starts = query_start_loc[:-1]
  has_token = query_start_loc[1:] - starts == 1
  rows = jnp.where(has_token, starts, num_tokens)  # num_tokens: dropped by the scatter
  arguments = dict(page_tables=page_tables, context_lens=jnp.where(has_token, context_lens, 0),
                   sm_scale=sm_scale, interpret=interpret)
  q_rows = q[jnp.minimum(rows, num_tokens - 1)]
  if decode_kernel == "mosaic":
    if soft_cap is not None:
      raise NotImplementedError("the Mosaic GPU decode kernel has no soft cap yet")
    from kvpage.device.backends.pallas import mosaic_decode  # needs jax >= 0.11.2

    mosaic_decode.check_supported(interpret)
    out = mosaic_decode.paged_decode_attention(q_rows, k_pages, v_pages, **arguments)
  else:
    out = decode.paged_decode_attention(q_rows, k_pages, v_pages, soft_cap=soft_cap,
                                        **arguments)
  return jnp.zeros_like(q).at[rows].set(out, mode="drop")


def _mixed(q, k_pages, v_pages, page_tables, context_lens, query_start_loc, *, sm_scale,
           soft_cap, interpret):
  return ragged.ragged_mixed_attention(
      q, k_pages, v_pages, page_tables=page_tables, context_lens=context_lens,
      query_start_loc=query_start_loc, sm_scale=sm_scale, soft_cap=soft_cap,
      interpret=interpret)


def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, *,
                           page_tables: jax.Array, context_lens: jax.Array,
                           query_start_loc: jax.Array, sm_scale: float | None = None,
                           soft_cap: float | None = None, interpret: bool = False,
                           decode_kernel: str = "triton") -> jax.Array:
  """Causal attention of a ragged batch of new tokens over a paged KV cache, in Pallas.

  Args:
    q: `[num_tokens, num_heads, head_dim]`; rows past `query_start_loc[-1]` are padding
      and come out as zeros.
    k_pages, v_pages: `[num_kv_heads, num_pages, page_size, head_dim]`.
    page_tables: `i32[num_seqs, max_pages_per_seq]`, padded with the null page 0.
    context_lens: `i32[num_seqs]`, KV length of each sequence including its new tokens.
    query_start_loc: `i32[num_seqs + 1]`, cumulative new-token counts from 0.
    sm_scale: score scale; defaults to `1 / sqrt(head_dim)`.
    soft_cap: if set, scores become `soft_cap * tanh(scores / soft_cap)`.
    interpret: run the Pallas interpreter (required on CPU).
    decode_kernel: the decode-only batches' kernel: `triton` (`decode.py`) or `mosaic`
      (`mosaic_decode.py`, Mosaic GPU, jax >= 0.11.2); mixed batches run the ragged
      Triton kernel either way.
  Returns:
    `[num_tokens, num_heads, head_dim]` in `q.dtype`.
  """
  reference.validate_static(q, k_pages, v_pages, page_tables, context_lens, query_start_loc)
  if q.shape[0] == 0:
    return q
  operands = (q, k_pages, v_pages, jnp.asarray(page_tables, jnp.int32),
              jnp.asarray(context_lens, jnp.int32), jnp.asarray(query_start_loc, jnp.int32))
  if decode_kernel not in DECODE_KERNELS:
    raise ValueError(f"unknown decode kernel {decode_kernel!r}; choose one of: "
                     f"{', '.join(DECODE_KERNELS)}")
  options = dict(sm_scale=sm_scale, soft_cap=soft_cap, interpret=interpret)
  query_lens = operands[5][1:] - operands[5][:-1]
  if not isinstance(query_lens, jax.core.Tracer):
    if bool(jnp.all(query_lens <= 1)):
      return _decode_rows(*operands, **options, decode_kernel=decode_kernel)
    return _mixed(*operands, **options)
  return jax.lax.cond(jnp.all(query_lens <= 1),
                      lambda *args: _decode_rows(*args, **options,
                                                 decode_kernel=decode_kernel),
                      lambda *args: _mixed(*args, **options), *operands)
