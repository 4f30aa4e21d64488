"""A decoder's shape and the bytes it follows from: KV bytes per token, weight bytes.

    kv_bytes_per_token = 2 (K and V) x bytes_per_element x num_layers x num_kv_heads x head_dim

Grouped-query attention (GQA) shares one KV head among `num_heads / num_kv_heads`
query heads and divides that figure by the same ratio; under tensor parallelism each
device holds its share of the KV heads (one replicated head when there are fewer heads
than devices). Real runs (the cache, the memory plan, pool sizing) and the simulator's
capacity model (`kvpage.sim.capacity`) share this arithmetic.

Pure Python: this module never imports jax.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

from kvpage.units import dtype_bytes


@dataclasses.dataclass(frozen=True)
class ModelShape:
  """The dimensions of a decoder-only Transformer that memory depends on."""

  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  d_model: int
  ffn_dim: int
  vocab_size: int
  tie_embeddings: bool = False
  name: str = "model"
  ffn_matrices: int = 3  # SwiGLU's gate, up, down; 2 for a plain MLP (OPT's fc1, fc2)
  learned_positions: int = 0  # rows of a learned position table (OPT), 0 for RoPE

  def __post_init__(self):
    for field in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "d_model",
                  "ffn_dim", "vocab_size"):
      value = getattr(self, field)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{self.name}: {field} must be a positive integer, got {value!r}")
    if self.ffn_matrices not in (2, 3):
      raise ValueError(f"{self.name}: ffn_matrices must be 2 (plain MLP) or 3 (SwiGLU), "
                       f"got {self.ffn_matrices!r}")
    if not isinstance(self.learned_positions, int) or self.learned_positions < 0:
      raise ValueError(f"{self.name}: learned_positions must be an integer >= 0, "
                       f"got {self.learned_positions!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"{self.name}: num_kv_heads={self.num_kv_heads} must divide "
          f"num_heads={self.num_heads} (GQA shares each KV head among a whole group)"
      )

  @classmethod
  def from_config(cls, config: Mapping[str, Any] | Any) -> "ModelShape":
    """Builds from a model config section (a ConfigDict or any mapping with these keys)."""
    get = config.get if hasattr(config, "get") else lambda key, default=None: getattr(
        config, key, default)
    fields = {f.name for f in dataclasses.fields(cls)}
    values = {name: get(name) for name in fields if get(name) is not None}
    return cls(**values)

  @property
  def group_size(self) -> int:
    """Query heads per KV head (1 for MHA)."""
    return self.num_heads // self.num_kv_heads


def check_positive(name: str, value: int) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
    raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_tensor_parallel(model: ModelShape, tensor_parallel: int) -> None:
  """Raises ValueError unless `model` splits over `tensor_parallel` devices: query heads
  and FFN features must divide evenly; KV heads must divide evenly or,
  when there are fewer of them than devices, divide the device count (each is then
  replicated, as vLLM does)."""
  check_positive("tensor_parallel", tensor_parallel)
  tp = tensor_parallel
  for field in ("num_heads", "ffn_dim"):  # the vocabulary is padded, as vLLM pads it
    if getattr(model, field) % tp:
      raise ValueError(f"{model.name}: {field}={getattr(model, field)} does not split over "
                       f"tensor_parallel={tp} devices")
  kv = model.num_kv_heads
  if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
    raise ValueError(f"{model.name}: num_kv_heads={kv} neither splits over nor replicates "
                     f"evenly onto tensor_parallel={tp} devices")


def kv_heads_per_device(model: ModelShape, tensor_parallel: int = 1) -> int:
  """KV heads one device holds: its share, or one replicated head when heads < devices."""
  return max(1, model.num_kv_heads // tensor_parallel)


def kv_bytes_per_token(model: ModelShape, dtype: str, tensor_parallel: int = 1) -> int:
  """Bytes of keys and values one token holds across all layers, on one device of a
  `tensor_parallel` group (all of them at 1)."""
  return (2 * dtype_bytes(dtype) * model.num_layers
          * kv_heads_per_device(model, tensor_parallel) * model.head_dim)


def num_parameters(model: ModelShape) -> int:
  """Parameters of a decoder: Llama-style (RMSNorm, no biases, SwiGLU, GQA) by default;
  `ffn_matrices=2` and `learned_positions` give OPT's plain MLP and position table
  (its biases and LayerNorm shifts, under 0.1% of the weights, are left out)."""
  d, hd = model.d_model, model.head_dim
  attention = d * model.num_heads * hd * 2 + d * model.num_kv_heads * hd * 2  # q, o; k, v
  mlp = model.ffn_matrices * d * model.ffn_dim
  norms = 2 * d
  embeddings = model.vocab_size * d * (1 if model.tie_embeddings else 2)
  return (model.num_layers * (attention + mlp + norms) + d + embeddings
          + model.learned_positions * d)


def weight_bytes(model: ModelShape, dtype: str) -> int:
  """Bytes of all weights stored in `dtype`."""
  return num_parameters(model) * dtype_bytes(dtype)
