"""Rotary position embeddings (Su et al. 2021) as Llama uses them, with Llama 3 scaling.

Llama rotates the two *halves* of each head (`rotate_half`), not interleaved pairs;
Hugging Face checkpoints store q/k projections in that order, so we must match it.
"""

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def inverse_frequencies(head_dim: int, theta: float,
                        scaling: Mapping[str, Any] | None = None) -> np.ndarray:
  """`f32[head_dim // 2]` rotation frequencies, optionally with Llama 3 scaling.

  Llama 3.1 stretches long wavelengths by `factor`, keeps short ones, and blends in
  between (Meta's `apply_scaling`, the `llama3` rope type in transformers).
  """
  inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  if not scaling or not scaling.get("enabled", False):
    return inv_freq.astype(np.float32)
  factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
  old_len = scaling["original_max_seq_len"]
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - low) / (high - low)
  blended = (1 - smooth) * scaled / factor + smooth * scaled
  is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
  return np.where(is_medium, blended, scaled).astype(np.float32)


def apply(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
  """Rotates `x: [num_tokens, num_heads, head_dim]` by each token's position."""
  angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
  cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, None, :]
  sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, None, :]
  x32 = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  return (x32 * cos + rotated * sin).astype(x.dtype)
