"""Ragged mixed attention over a paged KV cache: prefill chunks and decodes in one batch.

A continuous-batching step (Orca, OSDI'22) with chunked prefill (Sarathi-Serve,
OSDI'24) mixes sequences that bring a whole prompt, a chunk of one, or a single decode
token. The new tokens are flattened to `[num_tokens]`; sequence `s` owns rows
`query_start_loc[s]:query_start_loc[s + 1]`, which are the last positions of its
`context_lens[s]`-token history, each attending causally to positions <= its own.

The work is cut into **query blocks**: runs of up to `block_q` consecutive new tokens
of one sequence (`block_q` is the Pallas name for the query block; the XLA path calls
it `query_block`). A jnp prologue lists them (`schedule_query_blocks`, the schedule
of `xla.query_blocks`) so that the grid, `(query block, KV head)`, has a static size:
at most `num_tokens / block_q + num_seqs` blocks, the unused tail doing no work. Each
program stacks its block's tokens times the GQA group into one `[block_q * group,
head_dim]` matrix of query rows, walks its sequence's pages from position 0 up to its
last token one KV tile (`pages_per_tile` pages) at a time, and folds them into an
fp32 online softmax (FlashAttention, Dao et al. 2022) under the causal mask. It writes
its own block of output rows; a jnp epilogue gathers them back to token order, so no
two programs ever write the same rows, and padding rows come out as zeros.

This favours correctness and simplicity over peak prefill speed: KV is not split
across programs (prefill has many query blocks to fill the GPU anyway), and a decode
token that lands in a mixed batch takes a whole (mostly masked) query block. Batches
of decodes alone go to `decode.py`, which is built for them.

The file reads top-down as JAX's Pallas ops do: the kernel body, its `pallas_call`
wrapper, the schedule, then the public jitted `ragged_mixed_attention`. Its oracle is
`reference.ragged_paged_attention`, which `tests/test_kernels.py` compares it with.
See `common.py` for the lowering choice.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvpage.device.attention import reference
from kvpage.device.backends.pallas import common
from kvpage.device.backends.xla import attention as xla
from kvpage.units import cdiv

TOKENS_PER_TILE = 64  # keys per KV tile (one loop step) for 2-byte dtypes; halved for fp32
QUERY_ROWS = 64  # target rows (tokens x group) of a query block
NUM_SCHEDULE_FIELDS = 8  # seq, token_start, num_rows, first_position, context_len, 0, 0, 0


def _ragged_kernel(schedule_ref, page_tables_ref, q_ref, k_pages_ref, v_pages_ref, o_ref, *,
                   sm_scale: float, soft_cap: float | None, pages_per_tile: int,
                   precision) -> None:
  """One (query block, KV head): causal attention of the block's tokens to its sequence."""
  # schedule_ref: i32[NUM_SCHEDULE_FIELDS]          this block's entry (see schedule_...)
  # page_tables_ref: i32[num_seqs, max_pages_padded]
  # q_ref: [num_tokens_padded, group_padded, head_dim]          this KV head's queries
  # k_pages_ref, v_pages_ref: [num_pages, page_size, head_dim]  this KV head's pool
  # o_ref: [block_q, group_padded, head_dim]        this block's output rows
  seq, token_start, num_rows = schedule_ref[0], schedule_ref[1], schedule_ref[2]
  first_position, context_len = schedule_ref[3], schedule_ref[4]
  block_q, group, head_dim = o_ref.shape
  _, page_size, _ = k_pages_ref.shape
  tile_len = pages_per_tile * page_size
  rows = block_q * group
  q = q_ref[pl.ds(token_start, block_q)].reshape(rows, head_dim)
  # Row r is token r // group of the block; its position in the sequence:
  positions = first_position + jax.lax.broadcasted_iota(
      jnp.int32, (block_q, group), 0).reshape(rows, 1)
  key_offsets = jax.lax.broadcasted_iota(jnp.int32, (1, tile_len), 1)

  def fold_tile(tile, state):
    pages = page_tables_ref[seq, pl.ds(tile * pages_per_tile, pages_per_tile)]
    k = k_pages_ref[pages].reshape(tile_len, head_dim)  # [tile_len, head_dim]
    v = v_pages_ref[pages].reshape(tile_len, head_dim)
    key_positions = tile * tile_len + key_offsets
    # Causal; the length bound only matters to rows past the block's last real token.
    visible = (key_positions <= positions) & (key_positions < context_len)
    return common.online_softmax_step(q, k, v, visible, state, sm_scale=sm_scale,
                                      soft_cap=soft_cap, precision=precision)

  # Keys up to the block's last real token; unused grid slots have num_rows = 0.
  num_keys = jnp.where(num_rows > 0, first_position + num_rows, 0)
  state = jax.lax.fori_loop(0, cdiv(num_keys, tile_len), fold_tile,
                            reference.init_softmax_state((rows,), head_dim))
  out = reference.normalize(state)
  o_ref[...] = out.reshape(block_q, group, head_dim).astype(o_ref.dtype)


def _ragged_pallas_call(schedule, page_tables, q_grouped, k_pages, v_pages, *, block_q,
                        sm_scale, soft_cap, pages_per_tile, interpret):
  """Runs the kernel on a `(num_query_blocks, num_kv_heads)` grid.

  `q_grouped` is `[num_kv_heads, num_tokens + block_q, group_padded, head_dim]` (padded
  so every query block's load is in bounds). Returns each query block's output,
  `[num_query_blocks, num_kv_heads, block_q, group_padded, head_dim]` in q's dtype.
  """
  num_kv_heads, num_rows_padded, group_padded, head_dim = q_grouped.shape
  _, num_pages, page_size, _ = k_pages.shape
  num_query_blocks = schedule.shape[0]
  kernel = functools.partial(
      _ragged_kernel, sm_scale=sm_scale, soft_cap=soft_cap, pages_per_tile=pages_per_tile,
      precision=common.dot_precision(q_grouped.dtype))
  pool_spec = pl.BlockSpec((None, num_pages, page_size, head_dim), lambda b, h: (h, 0, 0, 0))
  return pl.pallas_call(
      kernel,
      grid=(num_query_blocks, num_kv_heads),
      in_specs=[
          pl.BlockSpec((None, NUM_SCHEDULE_FIELDS), lambda b, h: (b, 0)),
          pl.BlockSpec(page_tables.shape, lambda b, h: (0, 0)),
          pl.BlockSpec((None, num_rows_padded, group_padded, head_dim),
                       lambda b, h: (h, 0, 0, 0)),
          pool_spec, pool_spec,
      ],
      out_specs=pl.BlockSpec((None, None, block_q, group_padded, head_dim),
                             lambda b, h: (b, h, 0, 0, 0)),
      out_shape=jax.ShapeDtypeStruct(
          (num_query_blocks, num_kv_heads, block_q, group_padded, head_dim), q_grouped.dtype),
      compiler_params=common.compiler_params(interpret),
      interpret=interpret,
      name="kvpage_ragged_paged_attention",
  )(schedule, page_tables, q_grouped, k_pages, v_pages)


def schedule_query_blocks(query_start_loc: jax.Array, context_lens: jax.Array,
                          num_tokens: int, block_q: int) -> tuple[jax.Array, jax.Array]:
  """`xla.query_blocks`, its schedule rows zero-padded to `NUM_SCHEDULE_FIELDS`."""
  schedule, block_rows = xla.query_blocks(query_start_loc, context_lens, num_tokens, block_q)
  return jnp.pad(schedule, ((0, 0), (0, NUM_SCHEDULE_FIELDS - schedule.shape[1]))), block_rows


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "block_q",
                                             "pages_per_tile", "interpret"))
def ragged_mixed_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, *,
                           page_tables: jax.Array, context_lens: jax.Array,
                           query_start_loc: jax.Array, sm_scale: float | None = None,
                           soft_cap: float | None = None, block_q: int | None = None,
                           pages_per_tile: int | None = None,
                           interpret: bool = False) -> jax.Array:
  """Causal attention of a ragged mixed batch over a paged KV cache (one layer).

  Same contract as `reference.ragged_paged_attention` (q `[num_tokens, num_heads,
  head_dim]`, pages `[num_kv_heads, num_pages, page_size, head_dim]`, padding rows past
  `query_start_loc[-1]` give zeros), plus tiling overrides (`block_q` tokens per query
  block, `pages_per_tile` pages per KV tile) and `interpret`.
  """
  num_tokens, num_heads, head_dim = q.shape
  num_kv_heads, _, page_size, _ = k_pages.shape
  common.check_tiling(page_size, head_dim, interpret)
  group = num_heads // num_kv_heads
  group_padded = common.next_power_of_2(group)
  if block_q is None:  # a power of two, and >= 16 rows for Triton's tl.dot
    block_q = max(1, QUERY_ROWS // group_padded, common.MIN_DOT_DIM // group_padded)
  if pages_per_tile is None:
    pages_per_tile = common.pages_per_tile(page_size, page_tables.shape[1],
                                             TOKENS_PER_TILE * 2 // max(q.dtype.itemsize, 2))
  max_pages = cdiv(page_tables.shape[1], pages_per_tile) * pages_per_tile
  tables = jnp.pad(page_tables.astype(jnp.int32),
                   ((0, 0), (0, max_pages - page_tables.shape[1])))
  schedule, block_rows = schedule_query_blocks(
      query_start_loc.astype(jnp.int32), context_lens.astype(jnp.int32), num_tokens, block_q)
  q_grouped = jnp.pad(common.group_queries(q, num_kv_heads, group_padded),
                      ((0, 0), (0, block_q), (0, 0), (0, 0)))
  blocks = _ragged_pallas_call(
      schedule, tables, q_grouped, k_pages, v_pages, block_q=block_q,
      sm_scale=1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale,
      soft_cap=soft_cap, pages_per_tile=pages_per_tile, interpret=interpret)
  # [blocks, kv, block_q, gp, d] -> [blocks * block_q, kv, gp, d] -> token order.
  blocks = blocks.transpose(0, 2, 1, 3, 4).reshape(-1, num_kv_heads, group_padded, head_dim)
  out = blocks[jnp.maximum(block_rows, 0), :, :group]
  out = jnp.where((block_rows >= 0)[:, None, None, None], out, 0)
  return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)

