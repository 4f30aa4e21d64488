"""The XLA attention paths that serving runs: decode-only steps and query-blocked mixed steps.

Both compute what the oracle `reference.ragged_paged_attention` computes, and fold KV
tiles through the same online-softmax update (`reference.online_softmax_update`), but
run faster on XLA:CPU: they gather each sequence's pages once, as whole rows of a 2-D
view of the pool, instead of a copy per query token; they gather only as many pages as
the batch's longest context needs; and they read one layer straight out of the whole
cache `[num_layers, num_kv_heads, num_pages, page_size, head_dim]` when given `layer`,
so the step never copies a layer's pages.

  * `paged_decode_attention`: every sequence brings exactly one token (the host says
    so statically), so there is no ragged bookkeeping at all.
  * `ragged_blocked_attention`: any batch. Its decodes are rows of the decode path's
    computation; each prompt chunk is cut into query blocks (`query_blocks`, a schedule
    the Pallas ragged kernel shares) that a loop visits, only as many as there are,
    each reading its sequence's pages tile by tile up to its causal limit.

Both take optional `kernels` (`RowKernels`): a backend that computes some rows better
(the CPU backend's C++ kernels, which read the pages in place instead of gathering
them) hands its decode rows and prompt chunks over there; without them every row is
computed here.
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kvpage.device.attention import reference

# Measured on the 2-core CPU VM (variants interleaved in one process, tiny dims, one
# layer): tiles of 64 tokens beat 128 by 15-20% at batch 64 x 100 tokens, 32 x 600 and
# 32 x 2,000, and 256 is ~2x slower: a tile's gathered keys and values must stay in
# cache. The gather (a copy) is most of the cost: ~6-7 of ~9 ms at 32 x 2,000.
DECODE_TOKENS_PER_TILE = 64
# Single-pass widths (in pages) the XLA paths pick from at run time; table_bucket's ladder.
SPAN_LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
# Prompt chunks: query blocks of this many tokens, scored against KV tiles of this many.
# Chosen on the 2-core CPU VM (tiny dims, one layer, variants interleaved in one
# process): 256/256 beat blocks of 128 or 512 and tiles of 512 on fresh prompts,
# chunks over a cached prefix, and mixed decode + chunk steps alike.
PREFILL_QUERY_BLOCK = 256
PREFILL_TOKENS_PER_TILE = 256
# Smaller query blocks (and key tiles as long) a step whose longest prompt chunk fits
# takes instead: 32 prompts of 64 tokens would otherwise fill 256-row blocks a quarter.
PREFILL_BLOCK_LADDER = (64,)
# Below this many query rows per table, products with the keys are multiply-and-reduce.
MIN_MATMUL_ROWS = 8


def gather_rows(pages: jax.Array, rows: jax.Array) -> jax.Array:
  """Whole pages as rows of a 2-D view: `pages[..., page_size, head_dim]` flattened to
  `[rows, page_size * head_dim]`, then `rows` (any shape) gathered.

  Why this shape: XLA:CPU's gather moves contiguous rows at memcpy speed, while the
  4-D `k_pages[:, pages]` gather (and a gather whose index arithmetic is fused into
  it, recomputed for every element) runs several times slower.
  """
  page_size, head_dim = pages.shape[-2:]
  flat = pages.reshape(-1, page_size * head_dim)
  # lax.gather directly: numpy-style indexing would add a negative-index fix-up that,
  # fused into the gather, runs per element. Rows are in bounds by construction.
  dimension_numbers = jax.lax.GatherDimensionNumbers(
      offset_dims=(rows.ndim,), collapsed_slice_dims=(0,), start_index_map=(0,))
  return jax.lax.gather(flat, rows[..., None], dimension_numbers,
                        slice_sizes=(1, flat.shape[1]),
                        mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def decode_rows(page_tables: jax.Array, num_kv_heads: int, num_pages: int,
                layer: int = 0) -> jax.Array:
  """`i32[num_kv_heads, num_seqs, max_pages]`: the row of each table entry in the 2-D view
  of a `[num_layers, num_kv_heads, num_pages, ...]` pool (layer 0 for a one-layer pool).

  XLA fuses this arithmetic into the gather (an optimization barrier does not survive
  XLA:CPU's pipeline); that costs little next to moving the rows themselves.
  """
  heads = (layer * num_kv_heads + jnp.arange(num_kv_heads, dtype=jnp.int32)) * num_pages
  return heads[:, None, None] + page_tables[None]


class RowKernels(NamedTuple):
  """Kernels that take over rows of the XLA paths, each reading layer `layer` of the
  whole cache `[num_layers, num_kv_heads, num_pages, page_size, head_dim]` in place;
  None leaves those rows here.

  decode: `(q_seqs, k_cache, v_cache, page_tables, limits, *, layer, sm_scale, soft_cap)`
    -> `f32[n, num_heads, head_dim]`: one query row per table, seeing the keys below
    `limits[s]` (0: a zero row).
  prompt_chunks: `(q, k_cache, v_cache, page_tables, query_start_loc, context_lens, *,
    layer, sm_scale, soft_cap)` -> `f32[num_tokens, num_heads, head_dim]`: every prompt
    chunk's causal attention, zeros on the other rows.
  """

  decode: Callable[..., jax.Array] | None = None
  prompt_chunks: Callable[..., jax.Array] | None = None


NO_KERNELS = RowKernels()


def _layer_pool(pages: jax.Array, layer: int | None) -> jax.ShapeDtypeStruct:
  """The shape and dtype of one layer's pages, `[num_kv_heads, num_pages, page_size,
  head_dim]`, without slicing the whole cache (only the static check reads it)."""
  return jax.ShapeDtypeStruct(pages.shape if layer is None else pages.shape[1:], pages.dtype)


def paged_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, *,
                           page_tables: jax.Array, context_lens: jax.Array,
                           layer: int | None = None, sm_scale: float | None = None,
                           soft_cap: float | None = None,
                           tokens_per_tile: int = DECODE_TOKENS_PER_TILE,
                           kernels: RowKernels = NO_KERNELS) -> jax.Array:
  """`ragged_paged_attention` for a decode-only batch: token `s` is sequence `s`'s one new token.

  The host knows when a step is decode-only (every scheduled sequence brings exactly
  one token) and says so statically, so this path drops the ragged bookkeeping: no
  token-to-sequence search, no causal mask (the new token is the last position), no
  per-token copy of the page table. Each sequence's pages are gathered as whole rows
  and scored in one pass; contexts longer than `tokens_per_tile` fold tile by tile
  into an online softmax, as the reference does, so memory stays bounded.

  Args:
    q: `[num_tokens, num_heads, head_dim]`; row `s < num_seqs` belongs to sequence `s`,
      rows past the real sequences are padding and come out as zeros.
    k_pages, v_pages: `[num_kv_heads, num_pages, page_size, head_dim]`, or, with `layer`,
      the whole cache `[num_layers, num_kv_heads, ...]` (read in place: no layer slice).
    page_tables, context_lens: as in `ragged_paged_attention`; length-0 rows are padding.
    kernels: `kernels.decode`, if any, computes the rows instead.
  Returns:
    `[num_tokens, num_heads, head_dim]` in `q.dtype`.
  """
  pool = _layer_pool(k_pages, layer)
  num_seqs = page_tables.shape[0]
  reference.validate_static(q, pool, _layer_pool(v_pages, layer), page_tables, context_lens,
                            jax.ShapeDtypeStruct((num_seqs + 1,), jnp.int32))
  num_tokens, _, head_dim = q.shape
  _, num_pages, page_size, _ = pool.shape
  num_seqs = min(num_tokens, num_seqs)  # decode: seqs past num_tokens are empty
  sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
  out = _decode_pass(q[:num_seqs], k_pages, v_pages, page_tables[:num_seqs],
                     context_lens[:num_seqs], num_pages, layer, sm_scale, soft_cap,
                     max(1, tokens_per_tile // page_size), kernels.decode).astype(q.dtype)
  return jnp.pad(out, ((0, num_tokens - num_seqs), (0, 0), (0, 0)))


def _decode_pass(q_seqs, k_pages, v_pages, page_tables, limits, num_pages, layer, sm_scale,
                 soft_cap, pages_per_tile, decode_kernel):
  """One query token per table, `q_seqs [n, num_heads, head_dim]`, seeing the keys below
  `limits i32[n]` of its table; returns `f32[n, num_heads, head_dim]`. `decode_kernel`
  (`RowKernels.decode`), if given, computes them instead."""
  if decode_kernel is not None:
    whole = layer is not None  # the kernel reads layer `layer` of a whole cache
    return decode_kernel(q_seqs, k_pages if whole else k_pages[None],
                         v_pages if whole else v_pages[None], page_tables, limits,
                         layer=layer or 0, sm_scale=sm_scale, soft_cap=soft_cap)
  num_seqs, num_heads, head_dim = q_seqs.shape
  num_kv_heads = k_pages.shape[-4]
  q_grouped = (q_seqs.astype(jnp.float32) * sm_scale).reshape(
      num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(1, 0, 2, 3)
  rows = decode_rows(page_tables, num_kv_heads, num_pages, layer or 0)
  out = _fold(q_grouped, k_pages, v_pages, rows, limits[:, None], pages_per_tile, soft_cap)
  return out.transpose(1, 0, 2, 3).reshape(num_seqs, num_heads, head_dim)


def _fold(q_rows, k_pages, v_pages, rows, limits, pages_per_tile, soft_cap):
  """`_fold_tiles` over only as many table entries as the longest context needs.

  Tables are pinned wide (the model's whole context), so a fixed first tile would
  gather and score pages that no sequence in the batch holds yet. A `lax.switch` on
  the pages the batch needs picks the smallest single-pass span of `SPAN_LADDER` that
  holds them (compiled into the same program: no recompilation as contexts grow), and
  falls back to tiles of `pages_per_tile` beyond. Short contexts, the common decode
  case, then read and score a few pages rather than the table's width.
  """
  page_size = k_pages.shape[-2]
  spans = [span for span in SPAN_LADDER if span < min(pages_per_tile, rows.shape[-1])]
  if not spans:
    return _fold_tiles(q_rows, k_pages, v_pages, rows, limits, pages_per_tile, soft_cap)
  needed = -(-jnp.max(limits, initial=0) // page_size)
  index = sum((needed > span).astype(jnp.int32) for span in spans)

  def branch(span):
    if span is None:
      return lambda *args: _fold_tiles(*args, pages_per_tile, soft_cap)
    return lambda q, k, v, r, lim: _fold_tiles(q, k, v, r[..., :span], lim, span, soft_cap)

  return jax.lax.switch(index, [branch(span) for span in spans] + [branch(None)],
                        q_rows, k_pages, v_pages, rows, limits)


def _fold_tiles(q_rows, k_pages, v_pages, rows, limits, pages_per_tile, soft_cap):
  """Online softmax over KV tiles of `pages_per_tile` table entries (one pass if it fits).

  `q_rows: f32[num_kv_heads, n, m, head_dim]`: `m` query rows of each of `n` tables
  (a decode's query heads of one KV head, or a query block's tokens x heads); `rows`
  from `decode_rows`; `limits: i32[n, m or 1]`, the keys each query row sees
  (`key position < limit`). Returns the normalized `f32[num_kv_heads, n, m, head_dim]`.
  """
  num_kv_heads, num_tables, m, head_dim = q_rows.shape
  max_pages, page_size = rows.shape[-1], k_pages.shape[-2]
  pages_per_tile = min(pages_per_tile, max_pages)
  num_tiles_total = -(-max_pages // pages_per_tile)
  rows = jnp.pad(rows, ((0, 0), (0, 0), (0, num_tiles_total * pages_per_tile - max_pages)))
  tile_len = pages_per_tile * page_size
  kv_shape = (num_kv_heads, num_tables, tile_len, head_dim)

  def fold_tile(tile, state):
    tile_rows = jax.lax.dynamic_slice_in_dim(rows, tile * pages_per_tile, pages_per_tile, 2)
    k = gather_rows(k_pages, tile_rows).reshape(kv_shape).astype(jnp.float32)
    v = gather_rows(v_pages, tile_rows).reshape(kv_shape).astype(jnp.float32)
    if m < MIN_MATMUL_ROWS:
      # Multiply-and-reduce rather than einsum: XLA:CPU lowers these batched
      # matrix-vector products (a few rows against one table's keys) to a library call
      # per (head, table) pair, whose fixed cost dominates at decode sizes.
      scores = (q_rows[:, :, :, None, :] * k[:, :, None]).sum(axis=-1)
      weigh_values = lambda probs: (probs[..., None] * v[:, :, None]).sum(axis=3)
    else:  # query blocks: real matrix products, worth the call
      scores = jnp.einsum("ntmd,ntcd->ntmc", q_rows, k)
      weigh_values = lambda probs: jnp.einsum("ntmc,ntcd->ntmd", probs, v)
    if soft_cap is not None:
      scores = soft_cap * jnp.tanh(scores / soft_cap)
    key_positions = tile * tile_len + jnp.arange(tile_len)
    visible = key_positions < limits[..., None]  # [n, m or 1, tile_len]
    scores = jnp.where(visible[None], scores, -jnp.inf)
    return reference.online_softmax_update(state, scores, weigh_values)

  state = reference.init_softmax_state((num_kv_heads, num_tables, m), head_dim)
  if num_tiles_total == 1:
    state = fold_tile(0, state)
  else:
    num_tiles = jnp.minimum(-(-jnp.max(limits, initial=0) // tile_len), num_tiles_total)
    state = jax.lax.fori_loop(0, num_tiles, fold_tile, state)
  return reference.normalize(state)


def query_blocks(query_start_loc: jax.Array, context_lens: jax.Array, num_tokens: int,
                 query_block: int, *, multi_token_only: bool = False
                 ) -> tuple[jax.Array, jax.Array]:
  """Cuts every sequence's new tokens into query blocks of at most `query_block` (traceable).

  Returns `schedule i32[num_blocks, 5]`, rows (seq, first token, number of real
  tokens, position of the first token, context length), unused rows all zero, for a
  static `num_blocks = ceil(num_tokens / query_block) + num_seqs`; and `block_rows
  i32[num_tokens]`, each token's row `block_index * query_block + row` in the blocks'
  stacked output (-1 for padding tokens). The XLA blocked path and the Pallas ragged
  kernel share it. With `multi_token_only`, sequences of one new token get no block
  (the XLA path computes those as decodes); their tokens' `block_rows` are -1.
  """
  num_seqs = context_lens.shape[0]
  num_blocks = -(-num_tokens // query_block) + num_seqs
  query_lens = query_start_loc[1:] - query_start_loc[:-1]
  blocks_per_seq = -(-query_lens // query_block)
  if multi_token_only:
    blocks_per_seq = jnp.where(query_lens > 1, blocks_per_seq, 0)
  block_ends = jnp.cumsum(blocks_per_seq)
  first_block = block_ends - blocks_per_seq
  index = jnp.arange(num_blocks, dtype=jnp.int32)
  seq = jnp.minimum(jnp.searchsorted(block_ends, index, side="right"), num_seqs - 1)
  is_used = index < block_ends[-1]
  offset = (index - first_block[seq]) * query_block  # the block's first token, in its query
  fields = [seq, query_start_loc[seq] + offset,
            jnp.minimum(query_block, query_lens[seq] - offset),
            context_lens[seq] - query_lens[seq] + offset, context_lens[seq]]
  schedule = jnp.stack([jnp.where(is_used, f, 0) for f in fields], axis=1).astype(jnp.int32)

  seq_ids, _ = reference.token_layout(query_start_loc, context_lens, num_tokens)
  safe = jnp.maximum(seq_ids, 0)
  in_query = jnp.arange(num_tokens, dtype=jnp.int32) - query_start_loc[safe]
  row = (first_block[safe] + in_query // query_block) * query_block + in_query % query_block
  has_block = (seq_ids >= 0) & (blocks_per_seq[safe] > 0)
  return schedule, jnp.where(has_block, row, -1).astype(jnp.int32)


def ragged_blocked_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, *,
                             page_tables: jax.Array, context_lens: jax.Array,
                             query_start_loc: jax.Array, layer: int | None = None,
                             sm_scale: float | None = None, soft_cap: float | None = None,
                             query_block: int = PREFILL_QUERY_BLOCK,
                             tokens_per_tile: int = PREFILL_TOKENS_PER_TILE,
                             kernels: RowKernels = NO_KERNELS) -> jax.Array:
  """`ragged_paged_attention` for any batch: the fast XLA path for mixed steps.

  A mixed step holds two kinds of sequence, computed two ways and then put back in
  token order:
    * a sequence with one new token (a decode) is a row of `paged_decode_attention`'s
      computation, all of them at once;
    * a sequence with several (a prompt chunk) is cut into query blocks of
      `query_block` tokens (fewer, from `PREFILL_BLOCK_LADDER`, when the step's longest
      chunk is that short), and a loop runs over the blocks there are (a count known
      only on the device): a block reads its sequence's pages tile by tile, only as far
      as its last token's position (causal), and scores all its tokens against each
      tile at once, a real matrix product.
  So a step's cost follows its tokens and the pages they read, not its padded shape:
  padding sequences and padding blocks cost nothing, and a chunk of n tokens reads its
  context n / query_block times (the oracle reads it n times).

  Arguments and result as in `ragged_paged_attention`; with `layer`, `k_pages` and
  `v_pages` are the whole cache `[num_layers, num_kv_heads, ...]`, read in place;
  `kernels`, if any, compute the decode rows and the prompt chunks instead.
  """
  pool = _layer_pool(k_pages, layer)
  reference.validate_static(q, pool, _layer_pool(v_pages, layer), page_tables, context_lens,
                            query_start_loc)
  num_tokens, _, head_dim = q.shape
  num_pages, page_size = pool.shape[1:3]
  sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
  # Indexed by loop counters below: device arrays, whatever the caller passed.
  page_tables, context_lens, query_start_loc = (
      jnp.asarray(x) for x in (page_tables, context_lens, query_start_loc))
  query_lens = query_start_loc[1:] - query_start_loc[:-1]
  is_decode = query_lens == 1

  # Decodes: each sequence's last token, all sequences at once (only decodes see keys).
  last = jnp.maximum(query_start_loc[1:] - 1, 0)
  decode_out = _decode_pass(q[last], k_pages, v_pages, page_tables,
                            jnp.where(is_decode, context_lens, 0), num_pages, layer, sm_scale,
                            soft_cap, max(1, DECODE_TOKENS_PER_TILE // page_size),
                            kernels.decode)

  if kernels.prompt_chunks is not None:
    whole = layer is not None  # the kernel reads layer `layer` of a whole cache
    chunk_out = kernels.prompt_chunks(q, k_pages if whole else k_pages[None],
                                      v_pages if whole else v_pages[None], page_tables,
                                      query_start_loc, context_lens, layer=layer or 0,
                                      sm_scale=sm_scale, soft_cap=soft_cap)
  else:
    chunk_out = _blocked_prompt_chunks(q, k_pages, v_pages, page_tables, context_lens,
                                       query_start_loc, is_decode, query_lens, layer=layer,
                                       sm_scale=sm_scale, soft_cap=soft_cap,
                                       query_block=query_block, tokens_per_tile=tokens_per_tile)

  # Back to token order; padding tokens read zeros.
  seq_ids, _ = reference.token_layout(query_start_loc, context_lens, num_tokens)
  safe = jnp.maximum(seq_ids, 0)
  out = jnp.where(is_decode[safe][:, None, None], decode_out[safe], chunk_out)
  return jnp.where((seq_ids >= 0)[:, None, None], out, 0.0).astype(q.dtype)


def _blocked_prompt_chunks(q, k_pages, v_pages, page_tables, context_lens, query_start_loc,
                           is_decode, query_lens, *, layer, sm_scale, soft_cap, query_block,
                           tokens_per_tile):
  """`_prompt_chunks` with query blocks as large as the step's longest chunk needs, up
  to `query_block` (a `lax.switch`, so short prompts do not pad each block to the
  largest size)."""
  page_size = k_pages.shape[-2]
  sizes = [size for size in PREFILL_BLOCK_LADDER if size < query_block] + [query_block]
  longest = jnp.max(jnp.where(is_decode, 0, query_lens), initial=0)
  index = sum((longest > size).astype(jnp.int32) for size in sizes[:-1])
  branches = [
      lambda q, page_tables, context_lens, query_start_loc, size=size: _prompt_chunks(
          q, k_pages, v_pages, page_tables, context_lens, query_start_loc, layer=layer,
          sm_scale=sm_scale, soft_cap=soft_cap, query_block=size,
          pages_per_tile=max(1, min(size, tokens_per_tile) // page_size))
      for size in sizes]
  if len(sizes) == 1:
    return branches[0](q, page_tables, context_lens, query_start_loc)
  return jax.lax.switch(index, branches, q, page_tables, context_lens, query_start_loc)


def _prompt_chunks(q, k_pages, v_pages, page_tables, context_lens, query_start_loc, *, layer,
                   sm_scale, soft_cap, query_block, pages_per_tile):
  """Every prompt chunk's attention, `f32[num_tokens, num_heads, head_dim]` (zeros on the
  other rows): a loop over the chunks' query blocks of `query_block` tokens (the used
  ones lead the schedule), each scored against its sequence's pages tile by tile."""
  num_tokens, num_heads, head_dim = q.shape
  num_kv_heads, num_pages = k_pages.shape[-4], k_pages.shape[-3]
  group = num_heads // num_kv_heads
  schedule, _ = query_blocks(query_start_loc, context_lens, num_tokens, query_block,
                             multi_token_only=True)
  num_blocks = jnp.sum(schedule[:, 2] > 0)
  padded_q = jnp.pad(q, ((0, query_block), (0, 0), (0, 0)))
  offsets = jnp.arange(query_block, dtype=jnp.int32)

  def attend_block(index, out):
    seq, first_token, num_rows, first_position = (schedule[index, field] for field in range(4))
    block_q = jax.lax.dynamic_slice_in_dim(padded_q, first_token, query_block)
    q_rows = (block_q.astype(jnp.float32) * sm_scale).reshape(
        query_block, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3).reshape(
            num_kv_heads, 1, query_block * group, head_dim)
    limits = jnp.where(offsets < num_rows, first_position + offsets + 1, 0)
    rows = decode_rows(page_tables[seq][None], num_kv_heads, num_pages, layer or 0)
    block_out = _fold_tiles(q_rows, k_pages, v_pages, rows,
                            jnp.repeat(limits, group)[None], pages_per_tile, soft_cap)
    block_out = block_out.reshape(num_kv_heads, query_block, group, head_dim).transpose(
        1, 0, 2, 3).reshape(query_block, num_heads, head_dim)
    previous = jax.lax.dynamic_slice_in_dim(out, first_token, query_block)
    keep = (offsets < num_rows)[:, None, None]
    return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep, block_out, previous),
                                               first_token, 0)

  return jax.lax.fori_loop(0, num_blocks, attend_block, jnp.zeros(
      (num_tokens + query_block, num_heads, head_dim), jnp.float32))[:num_tokens]
