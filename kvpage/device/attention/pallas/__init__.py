"""The Pallas kernels' entry point: `ragged_paged_attention`, with the oracle's contract.

It has the contract of `reference.ragged_paged_attention` plus `interpret=`, and is
what `kvpage.device.attention.attention("pallas", ...)` calls (on one layer's pages,
interpreted on CPU). It picks one of two Pallas kernels:

  * every sequence has (at most) one new token -> `decode.paged_decode_attention`, the
    Flash-Decoding kernel that reads each KV page once per KV head;
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
from kvpage.device.attention.pallas import decode, ragged


def _decode_rows(q, k_pages, v_pages, page_tables, context_lens, query_start_loc, *,
                 sm_scale, soft_cap, interpret):
  """Runs the decode kernel on the one new row of each sequence, in place in `q`'s rows."""
  num_tokens = q.shape[0]
  starts = query_start_loc[:-1]
  has_token = query_start_loc[1:] - starts == 1
  rows = jnp.where(has_token, starts, num_tokens)  # num_tokens: dropped by the scatter
  out = decode.paged_decode_attention(
      q[jnp.minimum(rows, num_tokens - 1)], k_pages, v_pages, page_tables=page_tables,
      context_lens=jnp.where(has_token, context_lens, 0), sm_scale=sm_scale,
      soft_cap=soft_cap, interpret=interpret)
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
                           soft_cap: float | None = None, interpret: bool = False) -> jax.Array:
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
  Returns:
    `[num_tokens, num_heads, head_dim]` in `q.dtype`.
  """
  reference.validate_static(q, k_pages, v_pages, page_tables, context_lens, query_start_loc)
  if q.shape[0] == 0:
    return q
  operands = (q, k_pages, v_pages, jnp.asarray(page_tables, jnp.int32),
              jnp.asarray(context_lens, jnp.int32), jnp.asarray(query_start_loc, jnp.int32))
  options = dict(sm_scale=sm_scale, soft_cap=soft_cap, interpret=interpret)
  query_lens = operands[5][1:] - operands[5][:-1]
  if not isinstance(query_lens, jax.core.Tracer):
    if bool(jnp.all(query_lens <= 1)):
      return _decode_rows(*operands, **options)
    return _mixed(*operands, **options)
  return jax.lax.cond(jnp.all(query_lens <= 1),
                      lambda *args: _decode_rows(*args, **options),
                      lambda *args: _mixed(*args, **options), *operands)
