"""What a layer's non-attention work costs on one device, operator by operator.

Besides attention, a Llama-style decoder layer runs four projections (QKV, output,
gate+up, down), two RMSNorms, the rotary embedding, the SwiGLU activation and two
residual adds; under tensor parallelism (Megatron sharding) each device holds 1/tp of
the projections' output or input features, and two all-reduces a layer sum the
partial results. At `T` tokens in the step, each operator costs

    projection, a T x K by K x N GEMM:  floor + max(weight bytes / B_w,
                                                     2 T N K / (peak x e(T)))
        e(T) = e_max x T / (T + T_half)   the fraction of peak the GEMM reaches
    elementwise op (norm, rope, act, add, embedding):  floor + bytes moved / B_e
    all-reduce of S bytes over n devices:   latency_n + 2 (n - 1) / n x S / link_n

A GEMM reads its weights once however many rows it multiplies, so few tokens are bound
by `B_w`; many tokens by FLOPs, at an efficiency that rises with the rows per tile
wave: `e(T)` is one smooth curve over the token count, not two regimes. Rearranged,
the compute side is `2 T N K / (peak e_max) + 2 N K T_half / (peak e_max)`: each GEMM
pays `T_half` tokens' worth of compute on top, a cost the profiles pin down operator
by operator. The floors are the few microseconds a kernel costs however small it is.

The rates (`OperatorRates`) are fitted (`fit`) on measured per-operator times of
several models at many token counts and tensor-parallel degrees, the data a
step-level fit cannot separate into rates and fixed costs; one set of six numbers
prices every projection and elementwise op of every model (`leave_one_out` checks
that on models the fit has not seen). The fit weighs each operator by its share of a
layer's time, as the simulator adds them up: the curve is the large projections'
most. It still charges them too much between about 128 and 512 tokens (the profiles
show 0.71-0.74 of peak at 512 tokens, the curve 0.64): a step of a few hundred tokens,
a prompt chunk of 512, is priced about 10% high. All-reduces are fitted per group size on the
interconnect's own profile.

Hardware the rates were not measured on (`OperatorRates.carried_to`): the efficiency
curve and the floors carry over unchanged; the bandwidths scale by the ratio of the
datasheets' HBM bandwidths, the peak by the ratio of their dense FLOP/s, the
all-reduce's link rate by their interconnect bandwidths (latencies unchanged). A
kernel reaches the same fraction of a faster device's peak at the same shape: a
first-order rule, to re-measure where the device exists.

Pure Python + numpy + scipy: never imports jax.
"""

import csv
import dataclasses
import json
import math
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import optimize

from kvpage import model_shape
from kvpage.sim.hardware import HardwareSpec

# One layer's non-attention operators, in the order a layer runs them.
LAYER_OPERATORS = ("input_norm", "qkv", "rope", "output", "post_norm", "gate_up", "activation",
                   "down", "residual_adds")
# Once per step: the embedding lookup, the final norm and the LM head over sampled rows.
STEP_OPERATORS = ("embedding", "final_norm", "lm_head")
# The profile columns each operator is measured by (a profile times ONE residual add).
PROFILE_COLUMNS = dict(input_norm="input_layernorm", qkv="attn_pre_proj", rope="attn_rope",
                       output="attn_post_proj", post_norm="post_attention_layernorm",
                       gate_up="mlp_up_proj", activation="mlp_act", down="mlp_down_proj",
                       residual_adds="add", embedding="emb")
# All-reduces fitted up to this size: a step of 8,192 tokens at d_model 8,192 reduces
# 64 Mi fp16 elements; beyond, NCCL's bandwidth regime is not what steps meet.
ALLREDUCE_MAX_BYTES = 2 * 2**26
SHAPE_COLUMNS = ("model", "n_head", "n_kv_head", "n_embd", "n_expanded_embd", "num_tokens",
                 "tensor_parallel")


@dataclasses.dataclass(frozen=True)
class Operator:
  """One operator's work on one device: a GEMM (`n` x `k` weights, `tokens` rows) or an
  elementwise pass over `bytes_moved` bytes (read and written); `calls` of them."""

  kind: str  # "gemm" | "elementwise"
  tokens: int = 0
  n: int = 0
  k: int = 0
  bytes_moved: float = 0.0
  calls: int = 1


def layer_operators(model: model_shape.ModelShape, tokens: int, tensor_parallel: int,
                    itemsize: int) -> dict[str, Operator]:
  """One layer's non-attention operators at `tokens` tokens on one device of a
  `tensor_parallel` group (`itemsize` bytes per activation and weight element)."""
  tp, d, hd = tensor_parallel, model.d_model, model.head_dim
  q_heads = model.num_heads // tp
  kv_heads = model_shape.kv_heads_per_device(model, tp)
  ffn = model.ffn_dim // tp
  gated = model.ffn_matrices == 3

  def elementwise(elements: float, calls: int = 1) -> Operator:
    return Operator("elementwise", bytes_moved=elements * itemsize, calls=calls)

  return dict(
      input_norm=elementwise(2 * tokens * d),  # read the residual, write the normed
      qkv=Operator("gemm", tokens, (q_heads + 2 * kv_heads) * hd, d),
      rope=elementwise(0 if model.learned_positions else 2 * tokens * (q_heads + kv_heads) * hd),
      output=Operator("gemm", tokens, d, q_heads * hd),
      post_norm=elementwise(2 * tokens * d),
      gate_up=Operator("gemm", tokens, (2 if gated else 1) * ffn, d),
      activation=elementwise((3 if gated else 2) * tokens * ffn),  # SiLU(gate) x up
      down=Operator("gemm", tokens, d, ffn),
      residual_adds=elementwise(3 * tokens * d, calls=2))  # two adds: 2 reads, 1 write


def step_operators(model: model_shape.ModelShape, tokens: int, sampled: int,
                   tensor_parallel: int, itemsize: int) -> dict[str, Operator]:
  """What a step runs once, outside the layers: the embedding lookup and final norm of
  its `tokens`, and the LM head (the vocabulary split `tensor_parallel` ways) over the
  `sampled` rows."""
  d = model.d_model
  vocab = math.ceil(model.vocab_size / tensor_parallel)
  return dict(embedding=Operator("elementwise", bytes_moved=2 * tokens * d * itemsize),
              final_norm=Operator("elementwise", bytes_moved=2 * tokens * d * itemsize),
              lm_head=Operator("gemm", sampled, vocab, d))


@dataclasses.dataclass(frozen=True)
class Datasheet:
  """The datasheet figures of the device rates were measured on: what carrying them to
  another device scales by (dense FLOP/s, HBM bytes/s, interconnect bytes/s each way)."""

  name: str
  peak_flops: float
  hbm_bandwidth: float
  interconnect_bandwidth: float

  @classmethod
  def of(cls, hardware: HardwareSpec) -> "Datasheet":
    return cls(hardware.name, hardware.peak_flops, hardware.hbm_bandwidth,
               hardware.interconnect_bandwidth)

  def ratios(self, hardware: HardwareSpec) -> tuple[float, float, float]:
    """(peak, HBM, interconnect) of `hardware` over this datasheet's."""
    return (hardware.peak_flops / self.peak_flops, hardware.hbm_bandwidth / self.hbm_bandwidth,
            hardware.interconnect_bandwidth / self.interconnect_bandwidth)


@dataclasses.dataclass(frozen=True)
class AllReduceRate:
  """One group size's all-reduce: seconds = latency + ring bytes / bandwidth, where ring
  bytes are 2 (n - 1) / n of the reduced bytes (what each device sends)."""

  latency_s: float
  bandwidth: float


@dataclasses.dataclass(frozen=True)
class OperatorRates:
  """The fitted rates (see the module docstring), the datasheet of the device they were
  measured on (`measured_on`: what carrying them elsewhere scales by), and their
  provenance. `allreduce` maps interconnects (`HardwareSpec.network`) to the rates of
  their group sizes; `network` is the one this device uses (a network or group size the
  profiles lack is priced by the step rates' template all-reduce)."""

  gemm_floor_s: float
  gemm_bandwidth: float
  gemm_peak_fraction: float  # e_max
  gemm_half_tokens: float  # T_half
  elementwise_floor_s: float
  elementwise_bandwidth: float
  measured_on: Datasheet
  network: str
  allreduce: dict[str, dict[int, AllReduceRate]]
  source: str

  def __post_init__(self):
    for name in ("gemm_floor_s", "gemm_bandwidth", "gemm_half_tokens", "elementwise_floor_s",
                 "elementwise_bandwidth"):
      value = getattr(self, name)
      floor = name.endswith("_s")
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
          math.isfinite(value) and (value >= 0 if floor else value > 0)):
        raise ValueError(f"operator rates: {name} must be a finite number "
                         f"{'>= 0' if floor else '> 0'}, got {value!r}")
    if not 0 < self.gemm_peak_fraction <= 1:
      raise ValueError(f"operator rates: gemm_peak_fraction must be in (0, 1], got "
                       f"{self.gemm_peak_fraction!r}")

  def efficiency(self, tokens: float) -> float:
    """e(T): the fraction of peak FLOP/s a GEMM of `tokens` rows reaches."""
    return self.gemm_peak_fraction * tokens / (tokens + self.gemm_half_tokens)

  def gemm_bounds(self, op: Operator, itemsize: int) -> tuple[float, float]:
    """(seconds reading the weights, seconds computing) of one GEMM, without its floor."""
    weights = op.n * op.k * itemsize / self.gemm_bandwidth
    if op.tokens == 0:
      return weights, 0.0
    flops = 2.0 * op.tokens * op.n * op.k
    return weights, flops / (self.measured_on.peak_flops * self.efficiency(op.tokens))

  def seconds(self, op: Operator, itemsize: int) -> float:
    """One operator's seconds (all its calls); 0 for an operator with nothing to do."""
    if op.kind == "gemm":
      if op.tokens == 0:
        return 0.0
      return op.calls * (self.gemm_floor_s + max(self.gemm_bounds(op, itemsize)))
    if op.bytes_moved == 0:
      return 0.0
    return op.calls * (self.elementwise_floor_s + op.bytes_moved / self.elementwise_bandwidth)

  def allreduce_seconds(self, nbytes: float, devices: int) -> float | None:
    """One all-reduce of `nbytes` over `devices`; None where the group size was not
    profiled."""
    rate = self.allreduce.get(self.network, {}).get(devices)
    if rate is None:
      return None
    return rate.latency_s + 2 * (devices - 1) / devices * nbytes / rate.bandwidth

  def carried_to(self, hardware: HardwareSpec) -> "OperatorRates":
    """The rates on `hardware`, by the datasheet rule of the module docstring."""
    peak, memory, link = self.measured_on.ratios(hardware)
    if (peak, memory, link) == (1.0, 1.0, 1.0):
      return dataclasses.replace(self, network=hardware.network)
    return dataclasses.replace(
        self, gemm_bandwidth=self.gemm_bandwidth * memory,
        elementwise_bandwidth=self.elementwise_bandwidth * memory,
        measured_on=Datasheet.of(hardware), network=hardware.network,
        allreduce={network: {n: AllReduceRate(r.latency_s, r.bandwidth * link)
                             for n, r in sizes.items()}
                   for network, sizes in self.allreduce.items()},
        source=f"{self.source}; carried from {self.measured_on.name} to {hardware.name} by "
        f"the datasheets (peak x{peak:.3g}, HBM x{memory:.3g}, link x{link:.3g})")

  def to_dict(self) -> dict[str, Any]:
    values = dataclasses.asdict(self)
    values["allreduce"] = {network: {str(n): dataclasses.asdict(r) for n, r in sizes.items()}
                           for network, sizes in self.allreduce.items()}
    return values

  @classmethod
  def from_dict(cls, values: Any, where: str = "operator rates") -> "OperatorRates":
    names = {field.name for field in dataclasses.fields(cls)}
    got = set(values) if isinstance(values, dict) else set()
    if got != names:
      raise ValueError(f"{where}: unknown keys {sorted(got - names)}, missing "
                       f"{sorted(names - got)}")
    try:
      allreduce = {network: {int(n): AllReduceRate(**r) for n, r in sizes.items()}
                   for network, sizes in values["allreduce"].items()}
      measured_on = Datasheet(**values["measured_on"])
    except (TypeError, ValueError, AttributeError):
      raise ValueError(f"{where}: allreduce must map networks to group sizes to {{latency_s, "
                       "bandwidth}, measured_on be {name, peak_flops, hbm_bandwidth, "
                       "interconnect_bandwidth}") from None
    return cls(**dict(values, allreduce=allreduce, measured_on=measured_on))


# ---------------------------------------------------------------------------------------
# Profiles and fitting.


@dataclasses.dataclass(frozen=True)
class ProfileRow:
  """One profiled (model, tokens, tensor parallel): its shape and each operator's
  measured seconds (`PROFILE_COLUMNS`' names; `residual_adds` is ONE add, as profiled)."""

  model: str
  shape: model_shape.ModelShape
  tokens: int
  tensor_parallel: int
  seconds: dict[str, float]

  def layer_seconds(self) -> float:
    """The measured non-attention seconds of one layer (both residual adds)."""
    return sum(self.seconds[name] * (2 if name == "residual_adds" else 1)
               for name in LAYER_OPERATORS)


def read_profiles(path: str | pathlib.Path) -> list[ProfileRow]:
  """Rows of a per-operator profile CSV (`SHAPE_COLUMNS` and `PROFILE_COLUMNS`' columns
  with an `_ms` suffix, milliseconds per call): `configs/calibrations/vidur/a100_mlp.csv`."""
  with open(path, newline="") as handle:
    rows = list(csv.DictReader(handle))
  needed = [*SHAPE_COLUMNS, *(f"{c}_ms" for c in PROFILE_COLUMNS.values())]
  if not rows or any(column not in rows[0] for column in needed):
    raise ValueError(f"{path}: needs the columns {', '.join(needed)}")
  out = []
  for number, row in enumerate(rows, start=2):
    try:
      heads, kv_heads, d, ffn, tokens, tp = (int(float(row[c])) for c in SHAPE_COLUMNS[1:])
      seconds = {name: 1e-3 * float(row[f"{column}_ms"])
                 for name, column in PROFILE_COLUMNS.items()}
    except ValueError:
      raise ValueError(f"{path} line {number}: not numbers") from None
    shape = model_shape.ModelShape(num_layers=1, num_heads=heads, num_kv_heads=kv_heads,
                                   head_dim=d // heads, d_model=d, ffn_dim=ffn,
                                   vocab_size=1, name=row["model"])
    out.append(ProfileRow(row["model"], shape, tokens, tp, seconds))
  return out


def read_allreduce(path: str | pathlib.Path) -> dict[str, dict[int, list[tuple[float, float]]]]:
  """(bytes, seconds) of fp16 all-reduces by network and group size, from a CSV with
  `network`, `num_devices`, `size` (elements) and `all_reduce_ms`."""
  with open(path, newline="") as handle:
    rows = list(csv.DictReader(handle))
  out: dict[str, dict[int, list[tuple[float, float]]]] = {}
  for row in rows:
    out.setdefault(row["network"], {}).setdefault(int(row["num_devices"]), []).append(
        (2.0 * float(row["size"]), 1e-3 * float(row["all_reduce_ms"])))
  return out


def _unpack(x: np.ndarray) -> tuple[float, ...]:
  """Fit parameters (logs; e_max as a logit) to (gemm floor, gemm bandwidth, e_max,
  T_half, elementwise floor, elementwise bandwidth)."""
  return (math.exp(x[0]), math.exp(x[1]), 1.0 / (1.0 + math.exp(-x[2])), math.exp(x[3]),
          math.exp(x[4]), math.exp(x[5]))


def fit(rows: Sequence[ProfileRow],
        allreduce: dict[str, dict[int, list[tuple[float, float]]]], *,
        measured_on: Datasheet, network: str, itemsize: int = 2,
        source: str = "") -> OperatorRates:
  """Rates that price each profiled layer best, in relative terms: a least-squares fit
  of log(predicted / measured) of each row's non-attention layer time (the sum the
  simulator adds up, so each operator weighs by its share of the layer), with a
  soft-L1 loss so that a few outlying rows do not set the rates. All-reduces are
  fitted per network and group size of `allreduce` (`read_allreduce`'s); `network`:
  the one the measured device used."""
  if not rows:
    raise ValueError("fitting operator rates needs profile rows")
  layers = [layer_operators(row.shape, row.tokens, row.tensor_parallel, itemsize)
            for row in rows]
  measured = np.array([row.layer_seconds() for row in rows])
  if np.any(measured <= 0):
    raise ValueError("every profiled layer needs a time > 0")

  def residuals(x: np.ndarray) -> np.ndarray:
    rates = _rates(x, measured_on, network, {}, source)
    return np.log(np.array([sum(rates.seconds(op, itemsize) for op in ops.values())
                            for ops in layers]) / measured)

  bandwidth = measured_on.hbm_bandwidth
  start = np.array([math.log(5e-6), math.log(0.8 * bandwidth), 0.0, math.log(64.0),
                    math.log(3e-6), math.log(0.5 * bandwidth)])
  solution = optimize.least_squares(residuals, start, loss="soft_l1", f_scale=0.1).x
  return _rates(solution, measured_on, network,
                {name: {n: fit_allreduce(points, n) for n, points in sorted(sizes.items())}
                 for name, sizes in allreduce.items()}, source)


def _rates(x: np.ndarray, measured_on: Datasheet, network: str,
           allreduce: dict[str, dict[int, AllReduceRate]], source: str) -> OperatorRates:
  gemm_floor, gemm_bandwidth, peak_fraction, half_tokens, floor, bandwidth = _unpack(x)
  return OperatorRates(gemm_floor_s=gemm_floor, gemm_bandwidth=gemm_bandwidth,
                       gemm_peak_fraction=peak_fraction, gemm_half_tokens=half_tokens,
                       elementwise_floor_s=floor, elementwise_bandwidth=bandwidth,
                       measured_on=measured_on, network=network,
                       allreduce=allreduce, source=source)


def fit_allreduce(points: Sequence[tuple[float, float]], devices: int) -> AllReduceRate:
  """Latency and bandwidth of `devices`-way all-reduces from (reduced bytes, seconds)
  points, fitted on relative error (log residuals), so small messages (latency) weigh
  as much as large ones (bandwidth)."""
  points = [p for p in points if p[0] <= ALLREDUCE_MAX_BYTES]
  nbytes = np.array([p[0] for p in points]) * 2 * (devices - 1) / devices
  seconds = np.array([p[1] for p in points])

  def residuals(x: np.ndarray) -> np.ndarray:
    return np.log((math.exp(x[0]) + nbytes / math.exp(x[1])) / seconds)

  solution = optimize.least_squares(residuals, np.array([math.log(1e-5), math.log(1e11)]),
                                    loss="soft_l1", f_scale=0.1).x
  return AllReduceRate(latency_s=math.exp(solution[0]), bandwidth=math.exp(solution[1]))


def layer_seconds(rates: OperatorRates, model: model_shape.ModelShape, tokens: int,
                  tensor_parallel: int, itemsize: int) -> float:
  """One layer's non-attention seconds on one device (no all-reduce)."""
  return sum(rates.seconds(op, itemsize)
             for op in layer_operators(model, tokens, tensor_parallel, itemsize).values())


def layer_errors(rates: OperatorRates, rows: Sequence[ProfileRow],
                 itemsize: int = 2) -> np.ndarray:
  """predicted / measured - 1 of each row's whole layer (`ProfileRow.layer_seconds`)."""
  return np.array([layer_seconds(rates, row.shape, row.tokens, row.tensor_parallel, itemsize)
                   / row.layer_seconds() - 1.0 for row in rows])


def leave_one_out(rows: Sequence[ProfileRow], **fit_args: Any) -> list[dict[str, Any]]:
  """For each model of `rows`: fit on the others, judge the layer times of this one
  (median, 90th percentile and largest |error| over all its token counts and
  tensor-parallel degrees). `fit_args`: `fit`'s keywords (no all-reduces needed)."""
  table = []
  for held in sorted({row.model for row in rows}):
    rates = fit([row for row in rows if row.model != held], {}, **fit_args)
    errors = np.abs(layer_errors(rates, [row for row in rows if row.model == held]))
    table.append(dict(model=held, rows=len(errors), median=float(np.median(errors)),
                      p90=float(np.quantile(errors, 0.9)), max=float(errors.max())))
  return table


def load(path: str | pathlib.Path) -> OperatorRates:
  """The rates of an operator calibration file (`experiments.fit_operators`'s)."""
  path = pathlib.Path(path)
  try:
    record = json.loads(path.read_text())
  except OSError as error:
    raise ValueError(f"operator calibration {path}: cannot read it "
                     f"({error.strerror or error})") from None
  except json.JSONDecodeError as error:
    raise ValueError(f"operator calibration {path}: not JSON ({error.msg})") from None
  if not isinstance(record, dict) or "operators" not in record:
    raise ValueError(f"operator calibration {path}: no `operators` object")
  return OperatorRates.from_dict(record["operators"], where=f"operator calibration {path}")
