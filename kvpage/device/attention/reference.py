"""The reference ragged paged attention: one function for prefill, chunked prefill, decode.

One step of a continuous-batching server (Orca, OSDI'22) runs a *ragged* batch: the
new tokens of every scheduled sequence, flattened to `[num_tokens]`. Sequence `s`
owns rows `query_start_loc[s] : query_start_loc[s + 1]`; its KV history (those new
tokens included, written to the cache before attention runs) is `context_lens[s]`
tokens long and lives in the pages its page table lists. Its new tokens are the
*last* positions of that history, and each attends causally to positions <= its own.
Decode is one new token per sequence, prefill a whole prompt, chunked prefill
(Sarathi-Serve, OSDI'24) a chunk attending to its cached prefix plus itself.

This is the oracle every kernel and model in kvpage is checked against. It is
written for clarity, and is exact up to float rounding: for each token it walks its
sequence's page table a chunk of pages at a time, gathering those pages and
folding them into a running (online) softmax in fp32 (Milakov & Gimelshein 2018;
FlashAttention, Dao et al. 2022), so memory stays bounded by one chunk however long
the context, and the loop stops at the longest context in the batch.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_TOKENS_PER_CHUNK = 32  # two pages: prefill gathers per token, so short chunks waste least


def validate(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_tables: jax.Array,
             context_lens: jax.Array, query_start_loc: jax.Array) -> None:
  """Raises ValueError naming the first shape or dtype that does not fit the contract."""
  if q.ndim != 3:
    raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got shape {q.shape}")
  if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
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
  if page_tables.ndim != 2 or context_lens.shape != (num_seqs,):
    raise ValueError(f"page_tables must be [num_seqs, max_pages_per_seq] and context_lens "
                     f"[num_seqs]; got {page_tables.shape} and {context_lens.shape}")
  if query_start_loc.shape != (num_seqs + 1,):
    raise ValueError(f"query_start_loc must be [num_seqs + 1] = [{num_seqs + 1}], "
                     f"got {query_start_loc.shape}")
  if isinstance(context_lens, jax.core.Tracer):
    return  # Under jit the values are checked by the host batch builder.
  capacity = page_tables.shape[1] * k_pages.shape[2]
  longest = int(np.max(np.asarray(context_lens), initial=0))
  if longest > capacity:
    raise ValueError(f"page table too narrow: {page_tables.shape[1]} pages x "
                     f"{k_pages.shape[2]} tokens = {capacity} < context length {longest}")


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


def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, *,
                           page_tables: jax.Array, context_lens: jax.Array,
                           query_start_loc: jax.Array, sm_scale: float | None = None,
                           soft_cap: float | None = None,
                           tokens_per_chunk: int = DEFAULT_TOKENS_PER_CHUNK) -> jax.Array:
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
    tokens_per_chunk: KV tokens folded in per loop iteration (a memory/speed knob,
      rounded down to whole pages; results do not depend on it beyond rounding).
  Returns:
    `[num_tokens, num_heads, head_dim]` in `q.dtype`.
  """
  validate(q, k_pages, v_pages, page_tables, context_lens, query_start_loc)
  num_tokens, num_heads, head_dim = q.shape
  num_kv_heads, _, page_size, _ = k_pages.shape
  group = num_heads // num_kv_heads
  max_pages = page_tables.shape[1]
  pages_per_chunk = max(1, min(max_pages, tokens_per_chunk // page_size))
  num_chunks_total = -(-max_pages // pages_per_chunk)
  sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale

  seq_ids, positions = token_layout(query_start_loc, context_lens, num_tokens)
  is_real = seq_ids >= 0
  safe_seq = jnp.maximum(seq_ids, 0)
  # Pad the table to whole chunks with the null page; those keys are masked below.
  tables = jnp.pad(page_tables, ((0, 0), (0, num_chunks_total * pages_per_chunk - max_pages)))
  token_tables = tables[safe_seq]  # i32[num_tokens, num_chunks_total * pages_per_chunk]
  token_lens = jnp.where(is_real, context_lens[safe_seq], 0)
  # [num_kv_heads, num_tokens, group, head_dim]: query head h reads KV head h // group.
  # KV-head-major throughout, like the pages, so the gathered keys need no transpose.
  q_grouped = (q.astype(jnp.float32) * sm_scale).reshape(
      num_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
  chunk_len = pages_per_chunk * page_size

  def fold_chunk(chunk, carry):
    running_max, denominator, accumulator = carry
    pages = jax.lax.dynamic_slice_in_dim(token_tables, chunk * pages_per_chunk,
                                         pages_per_chunk, axis=1)
    # [num_kv_heads, num_tokens, pages_per_chunk, page_size, head_dim] -> per-token keys.
    k = k_pages[:, pages].reshape(num_kv_heads, num_tokens, chunk_len, head_dim)
    v = v_pages[:, pages].reshape(num_kv_heads, num_tokens, chunk_len, head_dim)
    scores = jnp.einsum("ktgd,ktcd->ktgc", q_grouped, k.astype(jnp.float32))
    if soft_cap is not None:
      scores = soft_cap * jnp.tanh(scores / soft_cap)
    key_positions = chunk * chunk_len + jnp.arange(chunk_len)
    visible = ((key_positions[None, :] <= positions[:, None])
               & (key_positions[None, :] < token_lens[:, None]))  # [num_tokens, chunk_len]
    scores = jnp.where(visible[None, :, None, :], scores, -jnp.inf)
    new_max = jnp.maximum(running_max, scores.max(axis=-1))
    safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
    probs = jnp.exp(scores - safe_max[..., None])
    rescale = jnp.exp(jnp.where(jnp.isfinite(running_max), running_max - safe_max, -jnp.inf))
    denominator = denominator * rescale + probs.sum(axis=-1)
    accumulator = accumulator * rescale[..., None] + jnp.einsum(
        "ktgc,ktcd->ktgd", probs, v.astype(jnp.float32))
    return new_max, denominator, accumulator

  stats_shape = (num_kv_heads, num_tokens, group)
  init = (jnp.full(stats_shape, -jnp.inf, jnp.float32), jnp.zeros(stats_shape, jnp.float32),
          jnp.zeros((*stats_shape, head_dim), jnp.float32))
  longest = jnp.max(token_lens, initial=0)
  num_chunks = jnp.minimum(-(-longest // chunk_len), num_chunks_total)
  _, denominator, accumulator = jax.lax.fori_loop(0, num_chunks, fold_chunk, init)
  out = accumulator / jnp.where(denominator > 0, denominator, 1.0)[..., None]
  out = out.transpose(1, 0, 2, 3)  # [num_tokens, num_kv_heads, group, head_dim]
  return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


