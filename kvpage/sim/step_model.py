"""What one step costs on a device, as a sum of named parts with calibrated rates.

A step of `T` tokens over `B` sequences, `S` of them sampled, on one device of a
tensor-parallel group of `tp`, takes

    launch                                   per step (kernel launches, host work)
  + prefill_launch, if it carries prompt chunks    only where a calibration shows one
  + idle_launch, if the device sat idle before it  only where a calibration shows one
  + per_sequence x B                         scheduling, sampling, metadata per sequence
  + non-attention work at T tokens           the projections, norms, rope, activation,
                                             residual adds of every layer, the embedding,
                                             and the LM head over S rows
  + prefill attention FLOPs / A_prefill      causal (query, key) pairs of prompt chunks
  + decode KV bytes / A_decode               every decode's context read once
  + 2 x layers x all-reduce(T x d_model)     tp > 1

The non-attention work is priced one of two ways:

  * `operators` (`kvpage.sim.operators`): operator by operator, from rates fitted on
    per-operator profiles (a GEMM's weight reads against its FLOPs at an efficiency
    curve over the token count, elementwise ops by bytes, all-reduces from the
    interconnect's profile). A mixed step is the sum of its parts at its total token
    count: its prompt chunks share the step's launch and its weight reads.
  * `regimes` (`RegimeRates`): a step-level roofline, `max(linear FLOPs / C_r, weight
    bytes / W_r)` with `r` the step's regime (`small` below `knee_tokens` tokens,
    `large` from there on), for devices measured only step by step (a kvpage run on
    this machine, `kvpage.sim.calibration`).

Every rate is an effective one (what kernels reach, not the datasheet's peak), so a
calibration (`kvpage.sim.calibration`) fits them to measured step times;
`StepRates.template` derives uncalibrated ones from a datasheet and template
efficiencies, and `StepRates.carried_to` carries measured ones to another device by
the ratios of the datasheets.

A step that carries prompt chunks may pay `prefill_launch` on top: kvpage's mixed XLA
program pads its prompt chunks to query blocks, a fixed cost a CPU run's steps show.
A step launched after the device sat idle for `IDLE_GAP_S` or more may pay
`idle_launch` on top: on a shared CPU a step after a pause runs on cold caches and
on cores that slept (measured on the 2-core VM: a prompt step after 12-600 ms of idle
took 1-30 ms longer than the same shape beside decodes, while steps 1-2 ms apart paid
nothing). Both are 0 unless a calibration finds them; a fit without the idle term
would read the cold prompt steps of a served run as a costlier mixed program and
overprice every warm one.

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

A chunk's prefill attention counts every pair it computes: a prompt in chunks computes
as many pairs as in one piece (each chunk's queries against the keys before and in
it), so chunking adds no attention FLOPs; what a chunk adds is its own launch, its
own reads of the weights and the GEMMs' per-call overhead at fewer rows.

Pure Python and numpy: never imports jax.
"""

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpage import metrics, model_shape, units
from kvpage.sim import operators as operators_lib
from kvpage.sim.hardware import HardwareSpec
from kvpage.sim.operators import Datasheet, OperatorRates

# A step launched this long after the device finished its last one starts cold
# (`StepWork.after_idle`); gaps between a busy engine's steps are well under it.
IDLE_GAP_S = 5e-3

PARTS = ("launch", "prefill_launch", "idle_launch", "sequences", "non_attention",
         "prefill_attention", "decode_attention", "allreduce", "swap")


def _check_rates(record: Any, names: Sequence[str], where: str) -> None:
  """Each of `names` a finite number: `_s` fields >= 0, the rest > 0."""
  for name in names:
    value = getattr(record, name)
    minimum_ok = value >= 0 if name.endswith("_s") else value > 0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        minimum_ok and math.isfinite(value)):
      raise ValueError(f"{where}: {name} must be a finite number "
                       f"{'>= 0' if name.endswith('_s') else '> 0'}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class RegimeRates:
  """The non-attention work as one roofline per regime: steps below `knee_tokens`
  tokens compute at `small_flops` and read weights at `small_bandwidth`, the rest at
  the `large_*` rates (a step-level fit, for a device without operator profiles)."""

  knee_tokens: int
  small_flops: float
  small_bandwidth: float
  large_flops: float
  large_bandwidth: float

  def __post_init__(self):
    _check_rates(self, [f.name for f in dataclasses.fields(self)], "regime rates")

  def carried(self, peak: float, memory: float) -> "RegimeRates":
    return dataclasses.replace(
        self, small_flops=self.small_flops * peak, large_flops=self.large_flops * peak,
        small_bandwidth=self.small_bandwidth * memory,
        large_bandwidth=self.large_bandwidth * memory)


@dataclasses.dataclass(frozen=True)
class StepRates:
  """Effective rates of a step's named parts (seconds, FLOP/s, bytes/s), with their source.

  The non-attention work is priced by `operators` or by `regimes` (exactly one; see
  the module docstring). The all-reduce's `allreduce_latency_s` and `link_bandwidth`
  (bytes/s each way per device) price group sizes the operator rates did not profile;
  they are the hardware entry's. `prefill_launch_s` is what a step carrying prompt
  chunks pays beyond `launch_s`, `idle_launch_s` what a step launched after the device
  idled (`StepWork.after_idle`) does (each 0 unless calibrated). `measured_on`: the datasheet of
  the device the rates were fitted on (None: a template), what `carried_to` scales by.
  `padded_work`: the rates price steps padded to the engine's buckets
  (`padded_counts`), as they were fit; `decode_reads_longest`: and each padded row's
  decode attention as reading as far as the step's longest decode context (the
  executor's `CostTraits.decode_reads_longest`: kvpage's XLA path), as the run they
  were fit on recorded. `noise_quantiles`: measured over predicted seconds of the steps
  the rates were fitted on, at evenly spaced quantiles from 0 to 1 (the residuals'
  distribution, scatter and misfit alike), which the simulator draws a multiplicative
  step-time noise from when asked to (`StepNoise`); empty: none recorded.
  """

  launch_s: float
  per_sequence_s: float
  prefill_attention_flops: float
  decode_attention_bandwidth: float
  allreduce_latency_s: float
  link_bandwidth: float
  source: str
  regimes: RegimeRates | None = None
  operators: OperatorRates | None = None
  prefill_launch_s: float = 0.0
  idle_launch_s: float = 0.0
  measured_on: Datasheet | None = None
  padded_work: bool = False
  decode_reads_longest: bool = False
  noise_quantiles: tuple[float, ...] = ()

  def __post_init__(self):
    object.__setattr__(self, "noise_quantiles", tuple(self.noise_quantiles))
    if self.noise_quantiles and not (
        all(q > 0 and math.isfinite(q) for q in self.noise_quantiles)
        and list(self.noise_quantiles) == sorted(self.noise_quantiles)
        and len(self.noise_quantiles) >= 2):
      raise ValueError("step rates: noise_quantiles must be at least two finite ratios > 0 in "
                       f"increasing order, got {self.noise_quantiles!r}")
    for name in ("padded_work", "decode_reads_longest"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"step rates: {name} must be true or false, got "
                         f"{getattr(self, name)!r}")
    if (self.regimes is None) == (self.operators is None):
      raise ValueError("step rates: give exactly one of `regimes` (a step-level roofline) "
                       "and `operators` (per-operator rates)")
    _check_rates(self, ("launch_s", "per_sequence_s", "prefill_attention_flops",
                        "decode_attention_bandwidth", "allreduce_latency_s", "link_bandwidth",
                        "prefill_launch_s", "idle_launch_s"), "step rates")

  @classmethod
  def template(cls, hardware: HardwareSpec) -> "StepRates":
    """Uncalibrated rates: the datasheet's peaks times the entry's template efficiencies,
    one efficiency for every token count, the entry's flat step overhead as launch."""
    flops = hardware.peak_flops * hardware.compute_efficiency
    bandwidth = hardware.hbm_bandwidth * hardware.bandwidth_efficiency
    return cls(launch_s=hardware.step_overhead_s, per_sequence_s=0.0,
               regimes=RegimeRates(knee_tokens=ridge_tokens(hardware), small_flops=flops,
                                   small_bandwidth=bandwidth, large_flops=flops,
                                   large_bandwidth=bandwidth),
               prefill_attention_flops=flops, decode_attention_bandwidth=bandwidth,
               allreduce_latency_s=hardware.interconnect_latency_s,
               link_bandwidth=hardware.interconnect_bandwidth,
               source=f"template: {hardware.name}'s datasheet x template efficiencies "
               f"({hardware.efficiency_source})")

  def carried_to(self, hardware: HardwareSpec) -> "StepRates":
    """These rates on `hardware`: FLOP-bound rates scaled by the ratio of the datasheets'
    dense peaks, byte-bound ones by their HBM bandwidths, the operators' all-reduces by
    their interconnects (`OperatorRates.carried_to`); launch, per-sequence and latency
    costs, host work, unchanged. Rates not measured on a device (a template) are
    returned as they are."""
    if self.measured_on is None or self.measured_on.name == hardware.name:
      return self
    peak, memory, _ = self.measured_on.ratios(hardware)
    return dataclasses.replace(
        self, prefill_attention_flops=self.prefill_attention_flops * peak,
        decode_attention_bandwidth=self.decode_attention_bandwidth * memory,
        regimes=self.regimes and self.regimes.carried(peak, memory),
        operators=self.operators and self.operators.carried_to(hardware),
        allreduce_latency_s=hardware.interconnect_latency_s,
        link_bandwidth=hardware.interconnect_bandwidth, measured_on=Datasheet.of(hardware),
        source=f"{self.source}; carried from {self.measured_on.name} to {hardware.name} by "
        f"the datasheets (peak x{peak:.3g}, HBM x{memory:.3g})")

  def to_dict(self) -> dict[str, Any]:
    values = dataclasses.asdict(self)
    if self.operators is not None:
      values["operators"] = self.operators.to_dict()
    return values

  @classmethod
  def from_dict(cls, values: dict[str, Any], where: str = "step rates") -> "StepRates":
    fields = dataclasses.fields(cls)
    names = {field.name for field in fields}
    required = {field.name for field in fields if field.default is dataclasses.MISSING}
    unknown, missing = set(values) - names, required - set(values)
    if unknown or missing:
      raise ValueError(f"{where}: unknown keys {sorted(unknown)}, missing {sorted(missing)}"
                       if unknown else f"{where}: missing keys {sorted(missing)}")
    values = dict(values)
    try:
      if values.get("regimes") is not None:
        values["regimes"] = RegimeRates(**values["regimes"])
      if values.get("measured_on") is not None:
        values["measured_on"] = Datasheet(**values["measured_on"])
    except TypeError as error:
      raise ValueError(f"{where}: {error}") from None
    if values.get("operators") is not None:
      values["operators"] = OperatorRates.from_dict(values["operators"], f"{where} operators")
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
  allreduce_bytes: float  # each all-reduce's reduced bytes per device
  num_allreduces: int
  swap_bytes: float = 0.0
  num_sampled: int = 0  # rows through the LM head
  after_idle: bool = False  # launched IDLE_GAP_S or more after the device's last step

  @property
  def has_prefill(self) -> bool:
    """True when a prompt chunk (of more than one token) is in the step."""
    return self.prefill_attention_flops > 0


@dataclasses.dataclass(frozen=True)
class StepCost:
  """A priced step: its work, each part's seconds, and which bound its largest
  projection hit ("compute" | "memory")."""

  work: StepWork
  parts: dict[str, float]
  linear_bound: str

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
    # Cached per shape: a served run prices the same few shapes thousands of times.
    self._layer = functools.lru_cache(maxsize=4096)(self._layer_costs)
    self.step_operator_parts = functools.lru_cache(maxsize=4096)(self._step_operator_parts)

  def with_rates(self, rates: StepRates) -> "StepModel":
    """The same model and device group, priced by other rates."""
    return StepModel(self.model, rates, weight_dtype=self.weight_dtype, kv_dtype=self.kv_dtype,
                     page_size=self.page_size, tensor_parallel=self.tensor_parallel,
                     host_link_bandwidth=self.host_link_bandwidth)

  def work(self, sequences: Sequence[tuple[int, int]], num_swapped_pages: int = 0,
           num_sampled: int | None = None, after_idle: bool = False) -> StepWork:
    """`sequences`: `(new tokens, context length including them)` per scheduled sequence;
    `num_sampled` rows go through the LM head (default: one per sequence);
    `after_idle`: the step starts after the device idled (`IDLE_GAP_S`)."""
    return self.work_from_counts(**metrics.step_counts(sequences, num_sampled),
                                 num_swapped_pages=num_swapped_pages, after_idle=after_idle)

  def work_from_counts(self, *, num_tokens: int, num_sequences: int, num_sampled: int,
                       prefill_pairs: int, decode_context: int,
                       num_swapped_pages: int = 0, after_idle: bool = False) -> StepWork:
    """`work` from a step's counts (`step_counts`; what `steps.jsonl` records)."""
    busy = num_tokens > 0
    return StepWork(
        num_tokens=num_tokens, num_sequences=num_sequences, num_sampled=num_sampled,
        linear_flops=2.0 * (self.layer_parameters * num_tokens
                            + self.head_parameters * num_sampled),
        weight_bytes=(self.weight_bytes + num_tokens * self.model.d_model
                      * self.weight_itemsize) if busy else 0.0,
        prefill_attention_flops=float(self.flops_per_pair * prefill_pairs),
        decode_kv_bytes=float(self.kv_bytes_per_token * decode_context),
        allreduce_bytes=float(num_tokens * self.model.d_model * self.weight_itemsize),
        num_allreduces=2 * self.model.num_layers if self.tensor_parallel > 1 and busy else 0,
        swap_bytes=float(num_swapped_pages * self.page_size * self.kv_bytes_per_token),
        after_idle=after_idle and busy)

  def _layer_costs(self, num_tokens: int) -> tuple[dict[str, float], str]:
    """One layer's non-attention operators at `num_tokens`, seconds each (operator
    rates), and the bound its largest projection (gate/up) hits."""
    rates = self.rates.operators
    assert rates is not None
    ops = operators_lib.layer_operators(self.model, num_tokens, self.tensor_parallel,
                                        self.weight_itemsize)
    memory, compute = rates.gemm_bounds(ops["gate_up"], self.weight_itemsize)
    return ({name: rates.seconds(op, self.weight_itemsize) for name, op in ops.items()},
            "compute" if compute >= memory else "memory")

  def layer_parts(self, num_tokens: int) -> dict[str, float]:
    """One layer's non-attention operators at `num_tokens`, seconds each (operator rates)."""
    return self._layer(num_tokens)[0]

  def _step_operator_parts(self, num_tokens: int, num_sampled: int) -> dict[str, float]:
    """The once-a-step operators' seconds: embedding, final norm, LM head."""
    rates = self.rates.operators
    assert rates is not None
    ops = operators_lib.step_operators(self.model, num_tokens, num_sampled,
                                       self.tensor_parallel, self.weight_itemsize)
    return {name: rates.seconds(op, self.weight_itemsize) for name, op in ops.items()}

  def allreduce_seconds(self, work: StepWork) -> float:
    """One all-reduce of the step's activations: the operators' profile for this group
    size, else the template's latency and link."""
    if not work.num_allreduces:
      return 0.0
    r, tp = self.rates, self.tensor_parallel
    profiled = r.operators and r.operators.allreduce_seconds(work.allreduce_bytes, tp)
    if profiled is not None:
      return profiled
    return r.allreduce_latency_s + 2 * (tp - 1) / tp * work.allreduce_bytes / r.link_bandwidth

  def _non_attention(self, work: StepWork) -> tuple[float, str]:
    """The non-attention work's seconds and the bound of its largest projection."""
    r = self.rates
    if r.operators is not None:
      if not work.num_tokens:
        return 0.0, "memory"
      layer, bound = self._layer(work.num_tokens)
      seconds = self.model.num_layers * sum(layer.values()) + sum(
          self.step_operator_parts(work.num_tokens, work.num_sampled).values())
      return seconds, bound
    assert r.regimes is not None
    regimes = r.regimes
    small = work.num_tokens < regimes.knee_tokens
    compute = work.linear_flops / (regimes.small_flops if small else regimes.large_flops)
    memory = work.weight_bytes / (regimes.small_bandwidth if small else regimes.large_bandwidth)
    return max(compute, memory), "compute" if compute >= memory else "memory"

  def price(self, work: StepWork, *, launch: bool = True) -> StepCost:
    """Each part's seconds; `launch=False` for a later iteration of a multi-step launch."""
    r = self.rates
    busy = work.num_tokens > 0 or work.swap_bytes > 0
    non_attention, bound = self._non_attention(work)
    parts = dict(
        launch=r.launch_s if busy and launch else 0.0,
        prefill_launch=r.prefill_launch_s if work.has_prefill and launch else 0.0,
        idle_launch=r.idle_launch_s if work.after_idle and launch else 0.0,
        sequences=r.per_sequence_s * work.num_sequences,
        non_attention=non_attention,
        prefill_attention=work.prefill_attention_flops / r.prefill_attention_flops,
        decode_attention=work.decode_kv_bytes / r.decode_attention_bandwidth,
        allreduce=work.num_allreduces * self.allreduce_seconds(work),
        swap=work.swap_bytes / self.host_link_bandwidth)
    return StepCost(work=work, parts=parts, linear_bound=bound)

  def named_parts(self, cost: StepCost) -> dict[str, float]:
    """A priced step's parts as a reader asks for them, in seconds: its launch (with any
    `prefill_launch` and `idle_launch`), per-sequence work, ONE layer's non-attention
    operators, all-reduces and attention on one device, the once-a-step operators
    (embedding, final norm, LM head), swaps, and the total. The total is the launch,
    sequences, step operators and swaps plus the number of layers times the three
    per-layer parts. With regime rates the non-attention work is one roofline: spread
    over the layers, head included."""
    parts, layers = cost.parts, self.model.num_layers
    step_ops = (sum(self.step_operator_parts(cost.work.num_tokens,
                                             cost.work.num_sampled).values())
                if self.rates.operators is not None and cost.work.num_tokens else 0.0)
    return dict(launch_s=parts["launch"] + parts["prefill_launch"] + parts["idle_launch"],
                sequences_s=parts["sequences"],
                non_attention_layer_s=(parts["non_attention"] - step_ops) / layers,
                all_reduce_layer_s=parts["allreduce"] / layers,
                attention_layer_s=(parts["prefill_attention"] + parts["decode_attention"])
                / layers,
                step_operators_s=step_ops, swap_s=parts["swap"], total_s=cost.seconds)

  def step_cost(self, sequences: Sequence[tuple[int, int]], num_swapped_pages: int = 0,
                num_sampled: int | None = None, *, launch: bool = True) -> StepCost:
    """`work` then `price`: one step's cost."""
    return self.price(self.work(sequences, num_swapped_pages, num_sampled), launch=launch)


class StepNoise:
  """A seeded multiplicative step-time noise: each step's seconds times a ratio drawn from
  `StepRates.noise_quantiles` (inverse-transform sampling, linear between quantiles).
  A fit that prices the median step (`loss="absolute"`) leaves the tail of real step
  times out of the simulator's mean; drawing the residuals back puts it in."""

  def __init__(self, quantiles: Sequence[float], seed: int):
    if len(quantiles) < 2:
      raise ValueError("step-time noise needs step rates with noise quantiles: rates fitted "
                       "by experiments.calibrate (templates have none)")
    self.quantiles = np.asarray(quantiles, dtype=np.float64)
    self.levels = np.linspace(0.0, 1.0, len(quantiles))
    self.rng = np.random.default_rng(seed)

  def factor(self) -> float:
    """The next step's ratio."""
    return float(np.interp(self.rng.random(), self.levels, self.quantiles))


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
