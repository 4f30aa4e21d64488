"""The contiguous KV-cache baseline: every sequence preallocates `max_len` slots.

This is what serving systems did before PagedAttention (Kwon et al., SOSP'23): a
`[num_seqs, num_kv_heads, max_len, head_dim]` slab per layer, reserved whole when the
sequence starts, however short it turns out. kvpage keeps it only as a yardstick for
the fragmentation measurement and the attention benchmarks; the engine never uses it.
"""

import math

import jax
import jax.numpy as jnp


def init(num_seqs: int, num_kv_heads: int, max_len: int, head_dim: int,
         dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
  """Zeroed `(k, v)` of one layer, each `[num_seqs, num_kv_heads, max_len, head_dim]`."""
  shape = (num_seqs, num_kv_heads, max_len, head_dim)
  return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array,
                     sm_scale: float | None = None) -> jax.Array:
  """One new token per sequence attending to its first `lengths[s]` cached tokens.

  Args:
    q: `[num_seqs, num_heads, head_dim]`.
    k, v: `[num_seqs, num_kv_heads, max_len, head_dim]`.
    lengths: `i32[num_seqs]`, tokens in each sequence's cache (the new one included).
  Returns:
    `[num_seqs, num_heads, head_dim]` in `q.dtype`.
  """
  num_seqs, num_heads, head_dim = q.shape
  num_kv_heads, max_len = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
  q = (q.astype(jnp.float32) * sm_scale).reshape(num_seqs, num_kv_heads, group, head_dim)
  scores = jnp.einsum("skgd,skld->skgl", q, k.astype(jnp.float32))
  visible = jnp.arange(max_len)[None, :] < lengths[:, None]  # [num_seqs, max_len]
  scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1)
  probs = jnp.where(visible[:, None, None, :], probs, 0.0)  # length-0 rows: zeros, not NaN
  out = jnp.einsum("skgl,skld->skgd", probs, v.astype(jnp.float32))
  return out.reshape(num_seqs, num_heads, head_dim).astype(q.dtype)
