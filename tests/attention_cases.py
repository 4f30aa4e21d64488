"""Random ragged paged-attention cases and a float64 dense oracle, shared by the tests.

A case is a list of sequences, each `(context_len, query_len)`: the sequence's KV
history is `context_len` tokens and its last `query_len` of them are new this step.
`make_case` scatters every sequence's history into randomly permuted pages (filled
with numpy, independently of kvpage's own write path) and builds the flattened
queries, page tables, lengths and query offsets, plus optional padding tokens and
padded (empty) sequences. `dense_attention` is plain causal attention on the unpaged
sequences, in float64.
"""

import dataclasses

import numpy as np


@dataclasses.dataclass
class Case:
  q: np.ndarray  # [num_tokens, num_heads, head_dim]
  k_pages: np.ndarray  # [num_kv_heads, num_pages, page_size, head_dim]
  v_pages: np.ndarray
  page_tables: np.ndarray  # i32[num_seqs, max_pages_per_seq]
  context_lens: np.ndarray  # i32[num_seqs]
  query_start_loc: np.ndarray  # i32[num_seqs + 1]
  keys: list[np.ndarray]  # per sequence, [context_len, num_kv_heads, head_dim]
  values: list[np.ndarray]
  num_real_tokens: int

  def kwargs(self) -> dict:
    return dict(page_tables=self.page_tables, context_lens=self.context_lens,
                query_start_loc=self.query_start_loc)


def make_case(seqs: list[tuple[int, int]], *, num_heads: int, num_kv_heads: int,
              head_dim: int, page_size: int, seed: int, num_pad_tokens: int = 0,
              num_pad_seqs: int = 0, extra_pages: int = 3, dtype=np.float32) -> Case:
  rng = np.random.default_rng(seed)
  pages_needed = [-(-ctx // page_size) for ctx, _ in seqs]
  num_pages = 1 + sum(pages_needed) + extra_pages
  order = rng.permutation(np.arange(1, num_pages))  # page 0 stays the null page
  max_pages = max([*pages_needed, 1]) + int(rng.integers(0, 2))  # sometimes padded wider
  shape = (num_kv_heads, num_pages, page_size, head_dim)
  k_pages = rng.standard_normal(shape).astype(dtype)  # garbage everywhere not written
  v_pages = rng.standard_normal(shape).astype(dtype)
  tables = np.zeros((len(seqs) + num_pad_seqs, max_pages), np.int32)
  keys, values, queries, next_page = [], [], [], 0
  for s, ((ctx, qlen), n) in enumerate(zip(seqs, pages_needed)):
    assert 1 <= qlen <= ctx
    pages = order[next_page:next_page + n]
    next_page += n
    tables[s, :n] = pages
    k = rng.standard_normal((ctx, num_kv_heads, head_dim)).astype(dtype)
    v = rng.standard_normal((ctx, num_kv_heads, head_dim)).astype(dtype)
    for pos in range(ctx):
      k_pages[:, pages[pos // page_size], pos % page_size] = k[pos]
      v_pages[:, pages[pos // page_size], pos % page_size] = v[pos]
    keys.append(k)
    values.append(v)
    queries.append(rng.standard_normal((qlen, num_heads, head_dim)).astype(dtype))
  queries.append(rng.standard_normal((num_pad_tokens, num_heads, head_dim)).astype(dtype))
  query_lens = [qlen for _, qlen in seqs] + [0] * num_pad_seqs
  return Case(
      q=np.concatenate(queries), k_pages=k_pages, v_pages=v_pages, page_tables=tables,
      context_lens=np.array([ctx for ctx, _ in seqs] + [0] * num_pad_seqs, np.int32),
      query_start_loc=np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32),
      keys=keys, values=values, num_real_tokens=int(sum(query_lens)))


def dense_attention(case: Case, sm_scale: float | None = None,
                    soft_cap: float | None = None) -> np.ndarray:
  """Causal attention per sequence on its unpaged keys/values, float64. Real rows only."""
  num_heads, head_dim = case.q.shape[1:]
  num_kv_heads = case.k_pages.shape[0]
  group = num_heads // num_kv_heads
  scale = 1 / np.sqrt(head_dim) if sm_scale is None else sm_scale
  out = []
  for s, (k, v) in enumerate(zip(case.keys, case.values)):
    start, end = case.query_start_loc[s], case.query_start_loc[s + 1]
    ctx = len(k)
    q = case.q[start:end].astype(np.float64)
    k = np.repeat(k.astype(np.float64), group, axis=1)  # [ctx, num_heads, head_dim]
    v = np.repeat(v.astype(np.float64), group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) * scale
    if soft_cap is not None:
      scores = soft_cap * np.tanh(scores / soft_cap)
    positions = ctx - (end - start) + np.arange(end - start)
    scores = np.where(np.arange(ctx)[None, :] <= positions[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out.append(np.einsum("hqk,khd->qhd", probs, v))
  return np.concatenate(out) if out else np.zeros((0, num_heads, head_dim))


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
  actual = np.asarray(actual, np.float64)
  return float(np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30))
