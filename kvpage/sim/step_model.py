"""What one step costs on a device, as a sum of named parts with calibrated rates.

A step of `T` tokens over `B` sequences, on one device of a tensor-parallel group of
`tp`, takes

    launch                                   per launch (kernel launches, host work)
  + prefill_launch, if it carries prompt chunks    the costlier program of a mixed step
  + per_sequence x B                         scheduling, sampling, metadata per sequence
  + max(linear FLOPs / C_r, weight bytes / W_r)   the projections, MLP and LM head
  + prefill attention FLOPs / A_prefill      causal (query, key) pairs of prompt chunks
  + decode KV bytes / A_decode               every decode's context read once
  + 2 x layers x (latency + ring bytes / link)  two all-reduces a layer (tp > 1)

where `r` is the step's regime: `small` below `knee_tokens` tokens, `large` from there
on (GEMM kernels for a few rows run at a different efficiency than for many, and a
batch of decodes reads the weights at a different rate than a prefill). Each rate is
an effective one (what kernels reach, not the datasheet's peak), so a calibration
(`kvpage.sim.calibration`) fits them to measured step times; `StepRates.template`
derives uncalibrated ones from a datasheet and template efficiencies.

A step that carries prompt chunks pays `prefill_launch` on top: engines run such
steps through a costlier program than a decode-only one (vLLM replays a captured CUDA
graph for decode batches and launches mixed batches eagerly; kvpage's mixed XLA
program pads its prompt chunks to query blocks), a fixed cost no token count explains.

Engines compute padded shapes (vLLM pads decode batches to CUDA-graph sizes; kvpage
pads every batch to its bucket ladder, `kvpage.batch.Buckets`), so a step costs what
its padded shape costs: rates fit on padded work (`padded_counts`, from a kvpage run's
`steps.jsonl`) say so (`StepRates.padded_work`), and the simulator then pads its steps
the same way before pricing them. kvpage's XLA decode pass also reads every padded row
as far as the step's longest decode context (one loop over key tiles for the whole
batch; a mixed step pins its rows to `max_num_seqs`), so there padded decode work is
rows x the longest context, not the sum of the contexts (`decode_reads_longest`; the
Pallas kernels read each row's own pages).

Work per device: the decoder layers' and LM head's weights are split `tp` ways
(Megatron: q/k/v/gate/up by output features, o/down by input features, the vocabulary
split), query heads split `tp` ways, KV heads too, each device holding at least one
(replicated when there are fewer KV heads than devices, as vLLM does).

A chunk's prefill attention counts every pair it computes, so later chunks of a
prompt pay for re-reading the earlier chunks' keys (pairs grow with the context
already in the cache), which makes chunked prefill cost more than one whole prefill.

Pure Python: never imports jax.
"""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from kvpage import metrics, model_shape, units
from kvpage.sim.hardware import HardwareSpec

PARTS = ("launch", "prefill_launch", "sequences", "linear", "prefill_attention", "decode_attention",
         "allreduce", "swap")


@dataclasses.dataclass(frozen=True)
class StepRates:
  """Effective rates of a step's named parts (seconds, FLOP/s, bytes/s), with their source.

  `small_*` price the linear layers of steps below `knee_tokens` tokens, `large_*` the
  rest. The all-reduce's `allreduce_latency_s` and `link_bandwidth` (bytes/s each way
  per device) come from the interconnect; a calibration on one tensor-parallel degree
  cannot separate them from the other parts, so they are the hardware entry's.
  `prefill_launch_s` is what a step carrying prompt chunks pays beyond `launch_s`
  (0 unless calibrated; a file without it reads as 0). `padded_work`: the rates price
  steps padded to the engine's buckets (`padded_counts`), as they were fit;
  `decode_reads_longest`: and each padded row's decode attention as reading as far as
  the step's longest decode context (the executor's `CostTraits.decode_reads_longest`:
  kvpage's XLA path), as the run they were fit on recorded.
  """

  launch_s: float
  per_sequence_s: float
  knee_tokens: int
  small_flops: float
  small_bandwidth: float
  large_flops: float
  large_bandwidth: float
  prefill_attention_flops: float
  decode_attention_bandwidth: float
  allreduce_latency_s: float
  link_bandwidth: float
  source: str
  prefill_launch_s: float = 0.0
  padded_work: bool = False
  decode_reads_longest: bool = False

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.name in ("padded_work", "decode_reads_longest") and not isinstance(value, bool):
        raise ValueError(f"step rates: {field.name} must be true or false, got {value!r}")
      if field.name in ("source", "padded_work", "decode_reads_longest"):
        continue
      minimum_ok = value >= 0 if field.name.endswith("_s") else value > 0
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
          minimum_ok and math.isfinite(value)):
        raise ValueError(f"step rates: {field.name} must be a finite number "
                         f"{'>= 0' if field.name.endswith('_s') else '> 0'}, got {value!r}")

  @classmethod
  def template(cls, hardware: HardwareSpec) -> "StepRates":
    """Uncalibrated rates: the datasheet's peaks times the entry's template efficiencies,
    one efficiency for every token count, the entry's flat step overhead as launch."""
    flops = hardware.peak_flops * hardware.compute_efficiency
    bandwidth = hardware.hbm_bandwidth * hardware.bandwidth_efficiency
    return cls(launch_s=hardware.step_overhead_s, per_sequence_s=0.0,
               knee_tokens=ridge_tokens(hardware), small_flops=flops,
               small_bandwidth=bandwidth, large_flops=flops, large_bandwidth=bandwidth,
               prefill_attention_flops=flops, decode_attention_bandwidth=bandwidth,
               allreduce_latency_s=hardware.interconnect_latency_s,
               link_bandwidth=hardware.interconnect_bandwidth,
               source=f"template: {hardware.name}'s datasheet x template efficiencies "
               f"({hardware.efficiency_source})")

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, values: dict[str, Any], where: str = "step rates") -> "StepRates":
    fields = dataclasses.fields(cls)
    names = {field.name for field in fields}
    required = {field.name for field in fields if field.default is dataclasses.MISSING}
    unknown, missing = set(values) - names, required - set(values)
    if unknown or missing:
      raise ValueError(f"{where}: unknown keys {sorted(unknown)}, missing {sorted(missing)}"
                       if unknown else f"{where}: missing keys {sorted(missing)}")
    return cls(**values)


def ridge_tokens(hardware: HardwareSpec) -> int:
  """The power of two at or below the datasheet's ridge point (peak FLOP/s over HBM
  bytes/s, i.e. tokens per step where a 16-bit weight read costs as much as its
  multiply-adds): the default knee between small and large steps."""
  ridge = hardware.peak_flops / hardware.hbm_bandwidth
  return 2 ** max(0, math.floor(math.log2(max(ridge, 1.0))))


@dataclasses.dataclass(frozen=True)
class StepWork:
  """What a step computes and moves on one device: the cost model's inputs."""

  num_tokens: int
  num_sequences: int
  linear_flops: float
  weight_bytes: float
  prefill_attention_flops: float
  decode_kv_bytes: float
  allreduce_bytes: float  # each all-reduce's ring traffic per device
  num_allreduces: int
  swap_bytes: float = 0.0

  @property
  def has_prefill(self) -> bool:
    """True when a prompt chunk (of more than one token) is in the step."""
    return self.prefill_attention_flops > 0


@dataclasses.dataclass(frozen=True)
class StepCost:
  """A priced step: its work, each part's seconds, and which bound the linear layers hit."""

  work: StepWork
  parts: dict[str, float]
  linear_bound: str  # "compute" | "memory"

  @property
  def seconds(self) -> float:
    return sum(self.parts.values())


class StepModel:
  """Prices steps of one model on one device of a `tensor_parallel` group."""

  def __init__(self, model: model_shape.ModelShape, rates: StepRates, *, weight_dtype: str,
               kv_dtype: str | None = None, page_size: int = 16, tensor_parallel: int = 1,
               host_link_bandwidth: float = 25e9):
    model_shape.check_tensor_parallel(model, tensor_parallel)
    self.model, self.rates, self.page_size = model, rates, page_size
    self.weight_dtype, self.kv_dtype = weight_dtype, kv_dtype or weight_dtype
    self.tensor_parallel, self.host_link_bandwidth = tensor_parallel, host_link_bandwidth
    tp = tensor_parallel
    self.weight_itemsize = units.dtype_bytes(weight_dtype)
    embedding = model.vocab_size * model.d_model
    layers = model_shape.num_parameters(model) - embedding * (1 if model.tie_embeddings else 2)
    # Per device: decoder layers and the LM head split tp ways; the input embedding is a
    # gather of T rows, counted with the weights' bytes.
    self.layer_parameters = layers / tp
    self.head_parameters = embedding / tp
    self.weight_bytes = (self.layer_parameters + self.head_parameters) * self.weight_itemsize
    self.kv_bytes_per_token = model_shape.kv_bytes_per_token(model, self.kv_dtype,
                                                          tensor_parallel=tp)
    self.flops_per_pair = 4 * model.num_layers * (model.num_heads // tp) * model.head_dim
    self.ring_fraction = 2 * (tp - 1) / tp

  def with_rates(self, rates: StepRates) -> "StepModel":
    """The same model and device group, priced by other rates."""
    return StepModel(self.model, rates, weight_dtype=self.weight_dtype, kv_dtype=self.kv_dtype,
                     page_size=self.page_size, tensor_parallel=self.tensor_parallel,
                     host_link_bandwidth=self.host_link_bandwidth)

  def work(self, sequences: Sequence[tuple[int, int]], num_swapped_pages: int = 0,
           num_sampled: int | None = None) -> StepWork:
    """`sequences`: `(new tokens, context length including them)` per scheduled sequence;
    `num_sampled` rows go through the LM head (default: one per sequence)."""
    return self.work_from_counts(**metrics.step_counts(sequences, num_sampled),
                                 num_swapped_pages=num_swapped_pages)

  def work_from_counts(self, *, num_tokens: int, num_sequences: int, num_sampled: int,
                       prefill_pairs: int, decode_context: int,
                       num_swapped_pages: int = 0) -> StepWork:
    """`work` from a step's counts (`step_counts`; what `steps.jsonl` records)."""
    busy = num_tokens > 0
    return StepWork(
        num_tokens=num_tokens, num_sequences=num_sequences,
        linear_flops=2.0 * (self.layer_parameters * num_tokens
                            + self.head_parameters * num_sampled),
        weight_bytes=(self.weight_bytes + num_tokens * self.model.d_model
                      * self.weight_itemsize) if busy else 0.0,
        prefill_attention_flops=float(self.flops_per_pair * prefill_pairs),
        decode_kv_bytes=float(self.kv_bytes_per_token * decode_context),
        allreduce_bytes=self.ring_fraction * num_tokens * self.model.d_model
        * self.weight_itemsize,
        num_allreduces=2 * self.model.num_layers if self.tensor_parallel > 1 and busy else 0,
        swap_bytes=float(num_swapped_pages * self.page_size * self.kv_bytes_per_token))

  def price(self, work: StepWork, *, launch: bool = True) -> StepCost:
    """Each part's seconds; `launch=False` for a later iteration of a multi-step launch."""
    r = self.rates
    small = work.num_tokens < r.knee_tokens
    compute = work.linear_flops / (r.small_flops if small else r.large_flops)
    memory = work.weight_bytes / (r.small_bandwidth if small else r.large_bandwidth)
    busy = work.num_tokens > 0 or work.swap_bytes > 0
    parts = dict(
        launch=r.launch_s if busy and launch else 0.0,
        prefill_launch=r.prefill_launch_s if work.has_prefill and launch else 0.0,
        sequences=r.per_sequence_s * work.num_sequences,
        linear=max(compute, memory),
        prefill_attention=work.prefill_attention_flops / r.prefill_attention_flops,
        decode_attention=work.decode_kv_bytes / r.decode_attention_bandwidth,
        allreduce=work.num_allreduces * (r.allreduce_latency_s
                                         + work.allreduce_bytes / r.link_bandwidth),
        swap=work.swap_bytes / self.host_link_bandwidth)
    return StepCost(work=work, parts=parts,
                    linear_bound="compute" if compute >= memory else "memory")

  def step_cost(self, sequences: Sequence[tuple[int, int]], num_swapped_pages: int = 0,
                num_sampled: int | None = None, *, launch: bool = True) -> StepCost:
    """`work` then `price`: one step's cost."""
    return self.price(self.work(sequences, num_swapped_pages, num_sampled), launch=launch)


def padded_counts(counts: dict[str, int], tokens: int, sequences: int,
                  decode_longest: int | None = None) -> dict[str, int]:
  """`step_counts` of a step as the engine computes it, padded to `tokens` x `sequences`
  (`Executor.step_shape`). A decode-only batch's padding rows run every layer (one token
  each, sampled); a mixed batch's padding tokens run the linear layers and its padding
  rows the per-sequence work (kvpage pins a mixed batch's rows to `max_num_seqs`, so
  with `prefill_launch` they are the mixed program's fixed cost). With
  `decode_longest` (the longest context of the step's decodes, `longest_decode`), each
  of the `sequences` rows reads that far, as kvpage's decode pass does; None (a record
  without it) keeps the sum of the contexts."""
  padded = dict(counts, num_tokens=tokens, num_sequences=sequences)
  if counts["num_tokens"] == counts["num_sequences"]:  # decode-only: padding rows sample too
    padded["num_sampled"] += sequences - counts["num_sequences"]
  if decode_longest is not None and counts["decode_context"]:
    padded["decode_context"] = sequences * decode_longest
  return padded
