"""One memory plan for real and simulated runs: how many KV pages a device holds.

As vLLM's `gpu_memory_utilization`: a run may use a fraction of the device's memory;
the weights come off that, then an activation reserve for the largest step the
scheduler can build; the KV pool takes the rest, in whole pages (the null page
included). Both kinds of run fill in the same terms, each with where it came from:

  * a real run reads the device's memory from JAX, the weights from the params'
    own bytes, and the reserve from XLA's buffer assignment of the compiled largest
    steps (`kvpage.device.step.Step.temp_bytes`);
  * a simulated run takes the hardware entry's memory, the weights from the model's
    shapes (`model_shape.weight_bytes`) and the reserve from `step_activation_bytes`,
    evaluated at the very same step shapes.

`step_activation_bytes` models what the XLA path keeps live in one step: the widest
point of a layer's linear part (residual stream, normed input, and the larger of the
QKV projection and the MLP's gate and up, or their SwiGLU alone where one kernel call
computes it) or of its attention (a decode tile of
gathered keys and values for every sequence, or a prompt chunk's query block against
one key tile), whichever is larger, plus the sampler's fp32 logits. On the tiny model
it lands within 20% of the measured temporaries (`tests/test_memory_plan.py` holds it
to a factor of 1.5 on two model sizes; `benchmarks/memory_plan.py` prints both).

Pure Python: this module never imports jax.
"""

import dataclasses

from kvpage import model_shape
from kvpage.interface import CostTraits
from kvpage.units import dtype_bytes

DEFAULT_UTILIZATION = 0.9  # vLLM's gpu_memory_utilization default


def _size(num_bytes: float) -> str:
  if abs(num_bytes) >= 2**30:
    return f"{num_bytes / 2**30:,.2f} GiB"
  return f"{num_bytes / 2**20:,.1f} MiB"


def step_activation_bytes(model: model_shape.ModelShape, *, num_tokens: int, num_seqs: int,
                          dtype: str, traits: CostTraits, kv_dtype: str | None = None,
                          tensor_parallel: int = 1) -> int:
  """Estimated peak temporaries of one step of `num_tokens` tokens over `num_seqs`
  sequences (padded shapes, as the step runs them) on one device of a group, for the
  backend whose cost `traits` (`kvpage.device.backends.traits`) say how large its
  attention tiles are and whether its MLP's gate and up products exist apart
  (`swiglu_fused`: only silu(gate) * up)."""
  if None in (traits.decode_tokens_per_tile, traits.prefill_query_block,
              traits.prefill_tokens_per_tile):
    raise ValueError(f"cost traits without attention tiles cannot size a step: {traits}")
  tp = tensor_parallel
  act, kv = dtype_bytes(dtype), dtype_bytes(kv_dtype or dtype)
  heads, kv_heads = model.num_heads // tp, model_shape.kv_heads_per_device(model, tp)
  qkv = (heads + 2 * kv_heads) * model.head_dim
  # gate and up (or their product alone), and the MLP's input
  mlp = (1 if traits.swiglu_fused else 2) * model.ffn_dim // tp + model.d_model
  linear = num_tokens * (2 * model.d_model + max(qkv, mlp)) * act
  tile = traits.decode_tokens_per_tile
  decode = num_seqs * tile * (2 * kv_heads * model.head_dim * kv + heads * 4)
  prefill = 0
  if num_tokens > num_seqs:  # a prompt chunk: one query block scored against one key tile
    block, keys = min(traits.prefill_query_block, num_tokens), traits.prefill_tokens_per_tile
    prefill = block * heads * keys * 4 * 2 + keys * 2 * kv_heads * model.head_dim * kv
  sampler = num_seqs * model.vocab_size * 4 * 2  # fp32 logits and their probabilities
  return max(linear, decode, prefill) + sampler


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """Every term of one device's memory plan, each with its source."""

  device_bytes: int
  device_source: str
  utilization: float
  weight_bytes: int
  weight_source: str
  activation_bytes: int
  activation_source: str
  page_bytes: int
  page_size: int

  def __post_init__(self):
    if not 0 < self.utilization <= 1:
      raise ValueError(f"cache.memory_utilization must be in (0, 1], got {self.utilization}")
    if self.page_bytes <= 0:
      raise ValueError(f"page_bytes must be > 0, got {self.page_bytes}")
    if self.kv_pool_bytes < 2 * self.page_bytes:
      raise ValueError(
          f"no room for a KV pool: {self.utilization:g} x {self.device_source} "
          f"{_size(self.device_bytes)} = {_size(self.usable_bytes)}, minus weights "
          f"{_size(self.weight_bytes)} and activations {_size(self.activation_bytes)}, leaves "
          f"{_size(max(self.kv_pool_bytes, 0))}, under two pages of "
          f"{self.page_bytes:,} bytes; raise cache.memory_utilization or use a smaller model")

  @property
  def usable_bytes(self) -> int:
    return int(self.utilization * self.device_bytes)

  @property
  def kv_pool_bytes(self) -> int:
    return self.usable_bytes - self.weight_bytes - self.activation_bytes

  @property
  def num_pages(self) -> int:
    """Pages of the pool, the null page included."""
    return self.kv_pool_bytes // self.page_bytes

  def reason(self) -> str:
    """One line for a run header: why the pool has `num_pages` pages."""
    return (f"memory plan: {self.utilization:g} x {_size(self.device_bytes)} "
            f"{self.device_source} - weights {_size(self.weight_bytes)} - activations "
            f"{_size(self.activation_bytes)} = KV {_size(self.kv_pool_bytes)}")

  def lines(self) -> list[str]:
    """The plan as arithmetic, one term a line, each with its source."""
    return [
        f"  {_size(self.device_bytes)} {self.device_source} x {self.utilization:g} "
        f"(cache.memory_utilization) = {_size(self.usable_bytes)}",
        f"- {_size(self.weight_bytes)} weights ({self.weight_source})",
        f"- {_size(self.activation_bytes)} activations ({self.activation_source})",
        f"= {_size(self.kv_pool_bytes)} KV pool: {self.num_pages:,} pages of "
        f"{self.page_size} tokens, {self.page_bytes / 2**10:,.0f} KiB each",
    ]

  @classmethod
  def from_dict(cls, record: dict) -> "MemoryPlan":
    """The plan `to_dict` wrote (its derived figures are recomputed)."""
    return cls(**{field.name: record[field.name] for field in dataclasses.fields(cls)})

  def to_dict(self) -> dict:
    return dict(dataclasses.asdict(self), usable_bytes=self.usable_bytes,
                kv_pool_bytes=self.kv_pool_bytes, num_pages=self.num_pages)
