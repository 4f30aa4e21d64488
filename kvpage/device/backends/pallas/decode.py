"""Flash-Decoding over a paged KV cache: the kernel for steps of one new token per sequence.

A decode step is memory-bound: each sequence's single query must read its whole KV
history, so the kernel is judged by how close its KV reads come to the HBM copy
bandwidth. Two things decide that:

  * **Read each page once per KV head.** A program owns one (sequence, KV head) pair
    and serves all `group = num_heads / num_kv_heads` query heads of that GQA group
    from the same page reads, as one `[group, head_dim] x [head_dim, tile_len]` matmul
    (the group is zero-padded to 16 rows, the smallest Triton `tl.dot`; the padded
    rows cost FLOPs, which decode has to spare, not bytes).
  * **Split long contexts** (Flash-Decoding, Dao et al. 2023). With batch 1 and 8 KV
    heads there would be only 8 programs for 132 SMs, so the context is cut into
    `num_splits` ranges of whole KV tiles, each folded by its own program into an
    unnormalised output plus its softmax max and denominator; a small jnp epilogue
    merges the splits by log-sum-exp.

Pages are head-major, `[num_kv_heads, num_pages, page_size, head_dim]` (PagedAttention,
Kwon et al., SOSP'23, and JAX's own Pallas kernels); the BlockSpec hands each program
its KV head's whole pool and the kernel gathers pages through the page table.
Accumulation is fp32 whatever the input dtype. See `common.py` for the lowering choice.

The file reads top-down as JAX's Pallas ops do: the kernel body, its `pallas_call`
wrapper, the split merge and tiling, then the public jitted `paged_decode_attention`.
Its oracle is `reference.ragged_paged_attention` (one query row per sequence), which
`tests/test_kernels.py` compares it with.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvpage.device.attention import reference
from kvpage.device.backends.pallas import common
from kvpage.units import cdiv

# Keys per KV tile (one loop step) for 2-byte dtypes: 8 pages of 16, as JAX's Triton paged
# attention. Halved for fp32 so the K and V tiles still fit shared memory with 2 stages.
TOKENS_PER_TILE = 128


def _decode_kernel(context_len_ref, page_tables_ref, q_ref, k_pages_ref, v_pages_ref,
                   acc_ref, max_ref, denominator_ref, *, sm_scale: float,
                   soft_cap: float | None, pages_per_tile: int, precision) -> None:
  """One (sequence, KV head, context split): fold the split's pages into softmax stats."""
  # context_len_ref: i32[1]                        this sequence's KV length
  # page_tables_ref: i32[pages_per_split]         this split's slice of the page table
  # q_ref: [group_padded, head_dim]                the GQA group's queries
  # k_pages_ref, v_pages_ref: [num_pages, page_size, head_dim]   this KV head's pool
  # acc_ref: f32[group_padded, head_dim]           unnormalised output of the split
  # max_ref, denominator_ref: f32[group_padded]    softmax max and sum of the split
  split = pl.program_id(2)
  pages_per_split = page_tables_ref.shape[0]
  _, page_size, head_dim = k_pages_ref.shape
  tile_len = pages_per_tile * page_size
  split_start = split * pages_per_split * page_size
  context_len = context_len_ref[0]
  # Splits past the end of a short sequence run zero iterations and report max -inf.
  split_len = jnp.clip(context_len - split_start, 0, pages_per_split * page_size)
  q = q_ref[...]
  key_offsets = jax.lax.broadcasted_iota(jnp.int32, (1, tile_len), 1)

  def fold_tile(tile, state):
    pages = page_tables_ref[pl.ds(tile * pages_per_tile, pages_per_tile)]
    k = k_pages_ref[pages].reshape(tile_len, head_dim)  # [tile_len, head_dim]
    v = v_pages_ref[pages].reshape(tile_len, head_dim)
    # The one query sits at position context_len - 1: every earlier key is visible.
    visible = split_start + tile * tile_len + key_offsets < context_len
    return common.online_softmax_step(q, k, v, visible, state, sm_scale=sm_scale,
                                      soft_cap=soft_cap, precision=precision)

  state = reference.init_softmax_state((q.shape[0],), head_dim)
  running_max, denominator, acc = jax.lax.fori_loop(
      0, cdiv(split_len, tile_len), fold_tile, state)
  max_ref[...] = running_max
  denominator_ref[...] = denominator
  acc_ref[...] = acc


def _decode_pallas_call(q_grouped, k_pages, v_pages, page_tables, context_lens, *,
                        sm_scale, soft_cap, num_splits, pages_per_tile, interpret):
  """Runs the kernel on a `(num_seqs, num_kv_heads, num_splits)` grid; per-split stats.

  `q_grouped` is `[num_kv_heads, num_seqs, group_padded, head_dim]`, `page_tables`
  `i32[num_seqs, num_splits * pages_per_split]`. Returns `f32` acc
  `[num_seqs, num_kv_heads, num_splits, group_padded, head_dim]` and max/denominator
  `[num_seqs, num_kv_heads, num_splits, group_padded]`.
  """
  num_kv_heads, num_seqs, group_padded, head_dim = q_grouped.shape
  _, num_pages, page_size, _ = k_pages.shape
  pages_per_split = page_tables.shape[1] // num_splits
  kernel = functools.partial(
      _decode_kernel, sm_scale=sm_scale, soft_cap=soft_cap, pages_per_tile=pages_per_tile,
      precision=common.dot_precision(q_grouped.dtype))
  pool_spec = pl.BlockSpec((None, num_pages, page_size, head_dim),
                           lambda s, h, k: (h, 0, 0, 0))
  stats_shape = (num_seqs, num_kv_heads, num_splits, group_padded)
  stats_spec = pl.BlockSpec((None, None, None, group_padded), lambda s, h, k: (s, h, k, 0))
  return pl.pallas_call(
      kernel,
      grid=(num_seqs, num_kv_heads, num_splits),
      in_specs=[
          pl.BlockSpec((None, 1), lambda s, h, k: (s, 0)),
          pl.BlockSpec((None, pages_per_split), lambda s, h, k: (s, k)),
          pl.BlockSpec((None, None, group_padded, head_dim), lambda s, h, k: (h, s, 0, 0)),
          pool_spec, pool_spec,
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, group_padded, head_dim),
                       lambda s, h, k: (s, h, k, 0, 0)),
          stats_spec, stats_spec,
      ],
      out_shape=[jax.ShapeDtypeStruct((*stats_shape, head_dim), jnp.float32),
                 jax.ShapeDtypeStruct(stats_shape, jnp.float32),
                 jax.ShapeDtypeStruct(stats_shape, jnp.float32)],
      compiler_params=common.compiler_params(interpret),
      interpret=interpret,
      name="kvpage_paged_decode",
  )(context_lens.reshape(num_seqs, 1), page_tables, q_grouped, k_pages, v_pages)


def merge_splits(acc: jax.Array, running_max: jax.Array, denominator: jax.Array) -> jax.Array:
  """Log-sum-exp merge of per-split softmax states over axis 2 (Flash-Decoding).

  Each split reports `acc = sum_j exp(s_j - m) v_j` and `denominator = sum_j exp(s_j - m)`
  for its own max `m`; rescaling every split to the global max makes them summable.
  Splits (or whole sequences) that saw no key have max -inf and weigh 0.
  """
  global_max = running_max.max(axis=2, keepdims=True)
  weight = jnp.exp(running_max - jnp.where(global_max == -jnp.inf, 0.0, global_max))
  total = (denominator * weight).sum(axis=2)
  out = (acc * weight[..., None]).sum(axis=2)
  return out / jnp.where(total > 0, total, 1.0)[..., None]


def decode_tiling(num_seqs: int, num_kv_heads: int, max_pages: int, page_size: int,
                  itemsize: int, num_splits: int | None,
                  pages_per_tile: int | None) -> tuple[int, int, int]:
  """`(pages_per_tile, num_splits, pages_per_split)` for a decode batch (all static)."""
  if pages_per_tile is None:
    pages_per_tile = common.pages_per_tile(page_size, max_pages,
                                             TOKENS_PER_TILE * 2 // max(itemsize, 2))
  num_tiles = cdiv(max_pages, pages_per_tile)
  if num_splits is None:
    num_splits = cdiv(common.TARGET_PROGRAMS, num_seqs * num_kv_heads)
  num_splits = max(1, min(num_splits, num_tiles))
  tiles_per_split = cdiv(num_tiles, num_splits)
  num_splits = cdiv(num_tiles, tiles_per_split)  # no split left empty by rounding
  return pages_per_tile, num_splits, tiles_per_split * pages_per_tile


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "num_splits",
                                             "pages_per_tile", "interpret"))
def paged_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, *,
                           page_tables: jax.Array, context_lens: jax.Array,
                           sm_scale: float | None = None, soft_cap: float | None = None,
                           num_splits: int | None = None, pages_per_tile: int | None = None,
                           interpret: bool = False) -> jax.Array:
  """Attention of one new token per sequence over its paged KV history.

  Args:
    q: `[num_seqs, num_heads, head_dim]`, the new token of each sequence, which sits at
      position `context_lens[s] - 1` (its own key and value already in the cache).
    k_pages, v_pages: `[num_kv_heads, num_pages, page_size, head_dim]`.
    page_tables: `i32[num_seqs, max_pages_per_seq]`, padded with the null page 0.
    context_lens: `i32[num_seqs]`; a length of 0 (a padded sequence) gives zeros.
    sm_scale, soft_cap: as in `reference.ragged_paged_attention`.
    num_splits, pages_per_tile: tiling overrides (default: `decode_tiling`).
    interpret: run the Pallas interpreter (CPU) instead of the Triton GPU kernel.
  Returns:
    `[num_seqs, num_heads, head_dim]` in `q.dtype`.
  """
  num_seqs, num_heads, head_dim = q.shape
  num_kv_heads, _, page_size, _ = k_pages.shape
  common.check_tiling(page_size, head_dim, interpret)
  group = num_heads // num_kv_heads
  pages_per_tile, num_splits, pages_per_split = decode_tiling(
      num_seqs, num_kv_heads, page_tables.shape[1], page_size, q.dtype.itemsize, num_splits,
      pages_per_tile)
  # Pad the table to whole splits with the null page; the length mask hides those keys.
  tables = jnp.pad(page_tables.astype(jnp.int32),
                   ((0, 0), (0, num_splits * pages_per_split - page_tables.shape[1])))
  group_padded = max(common.MIN_DOT_DIM, common.next_power_of_2(group))
  acc, running_max, denominator = _decode_pallas_call(
      common.group_queries(q, num_kv_heads, group_padded), k_pages, v_pages, tables,
      context_lens.astype(jnp.int32),
      sm_scale=1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale,
      soft_cap=soft_cap, num_splits=num_splits, pages_per_tile=pages_per_tile,
      interpret=interpret)
  out = merge_splits(acc, running_max, denominator)[:, :, :group]  # [seqs, kv, group, d]
  return out.reshape(num_seqs, num_heads, head_dim).astype(q.dtype)

