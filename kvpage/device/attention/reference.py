"""The reference ragged paged attention: the oracle for prefill, chunked prefill and decode.

One step of a continuous-batching server (Orca, OSDI'22) runs a *ragged* batch: the
new tokens of every scheduled sequence, flattened to `[num_tokens]`. Sequence `s`
owns rows `query_start_loc[s] : query_start_loc[s + 1]`; its KV history (those new
tokens included, written to the cache before attention runs) is `context_lens[s]`
tokens long and lives in the pages its page table lists. Its new tokens are the
*last* positions of that history, and each attends causally to positions <= its own.
Decode is one new token per sequence, prefill a whole prompt, chunked prefill
(Sarathi-Serve, OSDI'24) a chunk attending to its cached prefix plus itself.

`ragged_paged_attention` is the oracle every other path (the backends'
`xla/attention.py`, `cpu/`, `pallas/`) and the model are checked against. It is
written for clarity and is exact up to float
rounding: for each token it walks its sequence's page table one KV tile (a few pages)
at a time, gathering those pages and folding them into a running (online) softmax in
fp32 (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022), so memory stays
bounded by one tile however long the context, and the loop stops at the longest
context in the batch.

The module also holds what the other paths share with the oracle: the input contract
(`validate_static` for shapes and dtypes, `validate_dynamic` for the values of
concrete arrays), `token_layout`, and the online-softmax update itself
(`init_softmax_state`, `online_softmax_update`, `normalize`), written once.
"""

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

# Two pages of 16: the oracle gathers a KV tile per query token, so short tiles waste least.
DEFAULT_TOKENS_PER_TILE = 32

# (running max f32[...], denominator f32[...], unnormalized output f32[..., head_dim]).
SoftmaxState = tuple[jax.Array, jax.Array, jax.Array]
# What the checks accept: anything with a shape and a dtype (values only for the dynamic one).
Shaped = jax.Array | np.ndarray | jax.ShapeDtypeStruct


def validate_static(q: Shaped, k_pages: Shaped, v_pages: Shaped, page_tables: Shaped,
                    context_lens: Shaped, query_start_loc: Shaped) -> None:
  """Raises ValueError naming the first shape or dtype that does not fit the contract.

  Reads only `.shape` and `.dtype`, so it runs on tracers (under jit) and accepts
  `jax.ShapeDtypeStruct`s. Argument shapes as in `ragged_paged_attention`.
  """
  if len(q.shape) != 3:
    raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got shape {q.shape}")
  if len(k_pages.shape) != 4 or k_pages.shape != v_pages.shape:
    raise ValueError("k_pages and v_pages must both be [num_kv_heads, num_pages, page_size, "
                     f"head_dim], got {k_pages.shape} and {v_pages.shape}")
  num_heads, head_dim = q.shape[1:]
  num_kv_heads = k_pages.shape[0]
  if num_heads % num_kv_heads:
    raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
  if k_pages.shape[3] != head_dim:
    raise ValueError(f"head_dim of q ({head_dim}) != head_dim of the pages ({k_pages.shape[3]})")
  if not q.dtype == k_pages.dtype == v_pages.dtype:
    raise ValueError(f"mismatched dtypes: q {q.dtype}, k_pages {k_pages.dtype}, "
                     f"v_pages {v_pages.dtype}")
  num_seqs = page_tables.shape[0]
  if len(page_tables.shape) != 2 or context_lens.shape != (num_seqs,):
    raise ValueError(f"page_tables must be [num_seqs, max_pages_per_seq] and context_lens "
                     f"[num_seqs]; got {page_tables.shape} and {context_lens.shape}")
  if query_start_loc.shape != (num_seqs + 1,):
    raise ValueError(f"query_start_loc must be [num_seqs + 1] = [{num_seqs + 1}], "
                     f"got {query_start_loc.shape}")
  for name, x in (("page_tables", page_tables), ("context_lens", context_lens),
                  ("query_start_loc", query_start_loc)):
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"{name} must hold integers, got dtype {x.dtype}")


def validate_dynamic(q: Shaped, k_pages: Shaped, v_pages: Shaped, page_tables: Shaped,
                     context_lens: Shaped, query_start_loc: Shaped) -> None:
  """Raises ValueError naming the first value that breaks the contract (concrete arrays only).

  After `validate_static`, checks what shapes cannot: `query_start_loc` starts at 0,
  never decreases and ends within `q`'s rows; each context holds at least its new
  tokens and fits its page table; every page id names a page of the pool. Under jit
  the values are unknown here, so this raises TypeError on tracers rather than skip
  in silence: call it where the values are concrete (the host, tests), and
  `validate_static` everywhere.
  """
  validate_static(q, k_pages, v_pages, page_tables, context_lens, query_start_loc)
  if any(isinstance(x, jax.core.Tracer) for x in (page_tables, context_lens, query_start_loc)):
    raise TypeError("validate_dynamic needs concrete arrays; under jit use validate_static")
  # An explicit copy to the host: allowed under jax_transfer_guard, unlike np.asarray.
  tables, lens, starts = (np.asarray(x) for x in jax.device_get(
      (page_tables, context_lens, query_start_loc)))
  num_tokens, num_pages, page_size = q.shape[0], k_pages.shape[1], k_pages.shape[2]
  if starts[0] != 0:
    raise ValueError(f"query_start_loc must start at 0, got {starts[0]}")
  query_lens = np.diff(starts)
  if np.any(query_lens < 0):
    raise ValueError(f"query_start_loc must not decrease, got {starts.tolist()}")
  if starts[-1] > num_tokens:
    raise ValueError(f"query_start_loc ends at {starts[-1]} > num_tokens={num_tokens}")
  short = np.flatnonzero(lens < query_lens)
  if short.size:
    s = int(short[0])
    raise ValueError(f"sequence {s}: context length {lens[s]} < its {query_lens[s]} new tokens")
  capacity = tables.shape[1] * page_size
  longest = int(np.max(lens, initial=0))
  if longest > capacity:
    raise ValueError(f"page table too narrow: {tables.shape[1]} pages x {page_size} tokens "
                     f"= {capacity} < context length {longest}")
  if tables.size and (tables.min() < 0 or tables.max() >= num_pages):
    raise ValueError(f"page ids must lie in [0, {num_pages}), got {tables.min()} .. "
                     f"{tables.max()}")


def token_layout(query_start_loc: jax.Array, context_lens: jax.Array,
                 num_tokens: int) -> tuple[jax.Array, jax.Array]:
  """Each flattened token's sequence and position in that sequence.

  Returns `seq_ids i32[num_tokens]` (-1 for padding tokens past the last sequence) and
  `positions i32[num_tokens]`; a sequence's new tokens are its last positions.
  """
  token_index = jnp.arange(num_tokens, dtype=jnp.int32)
  seq_ids = jnp.searchsorted(query_start_loc[1:], token_index, side="right").astype(jnp.int32)
  num_seqs = context_lens.shape[0]
  is_real = seq_ids < num_seqs
  seq_ids = jnp.where(is_real, seq_ids, -1)
  safe = jnp.clip(seq_ids, 0, num_seqs - 1)
  query_lens = query_start_loc[1:] - query_start_loc[:-1]
  offset_in_query = token_index - query_start_loc[safe]
  positions = context_lens[safe] - query_lens[safe] + offset_in_query
  return seq_ids, jnp.where(is_real, positions, 0).astype(jnp.int32)


def init_softmax_state(shape: tuple[int, ...], head_dim: int) -> SoftmaxState:
  """The state before any key: max -inf, denominator 0, output 0, for query rows `shape`."""
  return (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
          jnp.zeros((*shape, head_dim), jnp.float32))


def online_softmax_update(state: SoftmaxState, scores: jax.Array,
                          weigh_values: Callable[[jax.Array], jax.Array]) -> SoftmaxState:
  """Folds one KV tile into the running softmax of every query row.

  Args:
    state: from `init_softmax_state` or a previous update, query rows `[...]`.
    scores: `f32[..., tile_keys]`, scaled (and soft-capped), -inf where a key is hidden.
    weigh_values: `probs f32[..., tile_keys] -> f32[..., head_dim]`, the products of
      the tile's values by `probs`; each path does that product its own fastest way.
  Returns:
    The state after the tile.
  """
  running_max, denominator, accumulator = state
  new_max = jnp.maximum(running_max, scores.max(axis=-1))
  # A row that has seen no visible key yet keeps max -inf; subtract 0 instead, so exp
  # gives 0s and never inf - inf = NaN. `running_max - safe_max` is then -inf: rescale 0.
  safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
  probs = jnp.exp(scores - safe_max[..., None])
  rescale = jnp.exp(running_max - safe_max)
  denominator = denominator * rescale + probs.sum(axis=-1)
  accumulator = accumulator * rescale[..., None] + weigh_values(probs)
  return new_max, denominator, accumulator


def normalize(state: SoftmaxState) -> jax.Array:
  """The attention output `f32[..., head_dim]`; rows that saw no key come out as zeros."""
  _, denominator, accumulator = state
  return accumulator / jnp.where(denominator > 0, denominator, 1.0)[..., None]


def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, *,
                           page_tables: jax.Array, context_lens: jax.Array,
                           query_start_loc: jax.Array, sm_scale: float | None = None,
                           soft_cap: float | None = None,
                           tokens_per_tile: int = DEFAULT_TOKENS_PER_TILE) -> jax.Array:
  """Causal attention of a ragged batch of new tokens over a paged KV cache (one layer).

  Args:
    q: `[num_tokens, num_heads, head_dim]`, the new tokens of all sequences, flattened.
      Rows past `query_start_loc[-1]` are padding; they come out as zeros.
    k_pages, v_pages: `[num_kv_heads, num_pages, page_size, head_dim]`.
    page_tables: `i32[num_seqs, max_pages_per_seq]`, padded with the null page 0.
    context_lens: `i32[num_seqs]`, KV length of each sequence including its new tokens.
    query_start_loc: `i32[num_seqs + 1]`, cumulative new-token counts from 0. Padded
      sequences have no tokens and length 0.
    sm_scale: score scale; defaults to `1 / sqrt(head_dim)`.
    soft_cap: if set, scores become `soft_cap * tanh(scores / soft_cap)` (Gemma 2).
    tokens_per_tile: KV tokens folded in per loop iteration (a memory/speed knob,
      rounded down to whole pages; results do not depend on it beyond rounding).
  Returns:
    `[num_tokens, num_heads, head_dim]` in `q.dtype`.
  Raises:
    ValueError: on shapes or dtypes that break the contract; with concrete (not
      traced) index arrays, also on values that do (`validate_dynamic`).
  """
  if any(isinstance(x, jax.core.Tracer) for x in (page_tables, context_lens, query_start_loc)):
    validate_static(q, k_pages, v_pages, page_tables, context_lens, query_start_loc)
  else:  # concrete index arrays: their values can be checked too
    validate_dynamic(q, k_pages, v_pages, page_tables, context_lens, query_start_loc)
  num_tokens, num_heads, head_dim = q.shape
  num_kv_heads, _, page_size, _ = k_pages.shape
  max_pages = page_tables.shape[1]
  pages_per_tile = max(1, min(max_pages, tokens_per_tile // page_size))
  num_tiles_total = -(-max_pages // pages_per_tile)
  sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale

  seq_ids, positions = token_layout(query_start_loc, context_lens, num_tokens)
  is_real = seq_ids >= 0
  safe_seq = jnp.maximum(seq_ids, 0)
  # Pad the table to whole tiles with the null page; those keys are masked below.
  tables = jnp.pad(page_tables, ((0, 0), (0, num_tiles_total * pages_per_tile - max_pages)))
  token_tables = tables[safe_seq]  # i32[num_tokens, num_tiles_total * pages_per_tile]
  token_lens = jnp.where(is_real, context_lens[safe_seq], 0)
  # [num_kv_heads, num_tokens, group, head_dim]: query head h reads KV head h // group.
  # KV-head-major throughout, like the pages, so the gathered keys need no transpose.
  q_grouped = (q.astype(jnp.float32) * sm_scale).reshape(
      num_tokens, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(1, 0, 2, 3)
  tile_len = pages_per_tile * page_size

  def fold_tile(tile, state):
    pages = jax.lax.dynamic_slice_in_dim(token_tables, tile * pages_per_tile, pages_per_tile,
                                         axis=1)
    # [num_kv_heads, num_tokens, pages_per_tile, page_size, head_dim] -> per-token keys.
    k = k_pages[:, pages].reshape(num_kv_heads, num_tokens, tile_len, head_dim)
    v = v_pages[:, pages].reshape(num_kv_heads, num_tokens, tile_len, head_dim)
    scores = jnp.einsum("ktgd,ktcd->ktgc", q_grouped, k.astype(jnp.float32))
    if soft_cap is not None:
      scores = soft_cap * jnp.tanh(scores / soft_cap)
    key_positions = tile * tile_len + jnp.arange(tile_len)
    visible = ((key_positions[None, :] <= positions[:, None])
               & (key_positions[None, :] < token_lens[:, None]))  # [num_tokens, tile_len]
    scores = jnp.where(visible[None, :, None, :], scores, -jnp.inf)
    return online_softmax_update(state, scores, lambda probs: jnp.einsum(
        "ktgc,ktcd->ktgd", probs, v.astype(jnp.float32)))

  state = init_softmax_state(q_grouped.shape[:3], head_dim)
  longest = jnp.max(token_lens, initial=0)
  num_tiles = jnp.minimum(-(-longest // tile_len), num_tiles_total)
  out = normalize(jax.lax.fori_loop(0, num_tiles, fold_tile, state))
  out = out.transpose(1, 0, 2, 3)  # [num_tokens, num_kv_heads, group, head_dim]
  return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
