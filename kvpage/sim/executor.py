"""A simulated GPU: a roofline cost model of one step, on a virtual clock.

`SimExecutor` runs no model. For each `SchedulerOutput` it prices the step on a
configured device and advances a `VirtualClock` by that many seconds, then emits a
dummy token for every sequence that samples, so requests run to their target length
(`max_tokens` with `ignore_eos`). The scheduler cannot tell it from a real model:
this is how the 13B setup runs on a laptop, in seconds, with the very same policy
code that serves real traffic.

The roofline (Williams et al., CACM 2009): a step takes the longer of
  * compute: 2 x (decoder-layer parameters) x tokens (every weight multiplies every
    token once, a multiply-add = 2 FLOPs), plus the LM head for the rows that sample
    only, plus attention, 4 x layers x heads x head_dim FLOPs for each (query, key)
    pair, over peak FLOP/s x compute efficiency (the input embedding is a gather);
  * memory: the weights read once per step (the embedding table only for its gathered
    rows, unless tied to the LM head), every context token's keys and values read,
    the new tokens' keys and values written, over HBM bandwidth x efficiency;
plus a fixed per-step overhead, plus swap copies over the host link. Prefill (many
tokens, one pass over the weights) comes out compute-bound and decode (one token
per sequence, every weight and KV byte re-read) bandwidth-bound.

Under the `Executor` contract a simulated step has no device to wait for: `submit`
runs it (the clock advances then) and its ticket is the samples, which `collect`
hands back; nothing compiles, so `warmup` does nothing and `num_compiles` is 0.
"""

import dataclasses
from typing import Any

from kvpage import units
from kvpage.interface import Executor, Samples, SchedulerOutput
from kvpage.sim import capacity
from kvpage.sim.clock import PacedClock, VirtualClock
from kvpage.sim.hardware import HardwareSpec

DUMMY_TOKEN = 1


@dataclasses.dataclass(frozen=True)
class StepCost:
  """The priced parts of one step (FLOPs, bytes, seconds) and which bound won."""

  num_tokens: int
  flops: float
  bytes_moved: float
  swap_bytes: float
  compute_s: float
  memory_s: float
  swap_s: float
  overhead_s: float

  @property
  def seconds(self) -> float:
    return max(self.compute_s, self.memory_s) + self.overhead_s + self.swap_s

  @property
  def bound(self) -> str:
    return "compute" if self.compute_s >= self.memory_s else "memory"


class Roofline:
  """Prices a step of a given model on a given device."""

  def __init__(self, model: capacity.ModelShape, hardware: HardwareSpec, *,
               weight_dtype: str, kv_dtype: str | None = None, page_size: int = 16):
    self.model, self.hardware, self.page_size = model, hardware, page_size
    self.embedding_parameters = model.vocab_size * model.d_model
    self.layer_parameters = capacity.num_parameters(model) - self.embedding_parameters * (
        1 if model.tie_embeddings else 2)
    self.weight_itemsize = units.dtype_bytes(weight_dtype)
    # Read every step: decoder layers and the LM head (which is the table, when tied).
    self.weight_bytes = (self.layer_parameters + self.embedding_parameters) * self.weight_itemsize
    self.kv_bytes_per_token = capacity.kv_bytes_per_token(model, kv_dtype or weight_dtype)
    self.flops_per_pair = 4 * model.num_layers * model.num_heads * model.head_dim

  def step_cost(self, sequences: list[tuple[int, int]], num_swapped_pages: int = 0,
                num_sampled: int | None = None) -> StepCost:
    """`sequences`: `(new tokens, context length including them)` per scheduled sequence;
    `num_sampled` rows go through the LM head (default: one per sequence)."""
    num_tokens = sum(n for n, _ in sequences)
    num_sampled = len(sequences) if num_sampled is None else num_sampled
    # Query i of n new tokens in a context of c sees c - n + i + 1 keys.
    pairs = sum(n * (c - n) + n * (n + 1) // 2 for n, c in sequences)
    flops = (2.0 * self.layer_parameters * num_tokens
             + 2.0 * self.embedding_parameters * num_sampled + self.flops_per_pair * pairs)
    context_tokens = sum(c - n for n, c in sequences)
    embedding_rows = num_tokens * self.model.d_model * self.weight_itemsize
    bytes_moved = ((self.weight_bytes + embedding_rows) if sequences else 0) + (
        self.kv_bytes_per_token * (context_tokens + num_tokens))
    swap_bytes = num_swapped_pages * self.page_size * self.kv_bytes_per_token
    hw = self.hardware
    return StepCost(
        num_tokens=num_tokens, flops=flops, bytes_moved=bytes_moved, swap_bytes=swap_bytes,
        compute_s=flops / (hw.peak_flops * hw.compute_efficiency),
        memory_s=bytes_moved / (hw.hbm_bandwidth * hw.bandwidth_efficiency),
        swap_s=swap_bytes / hw.host_link_bandwidth,
        overhead_s=hw.step_overhead_s if sequences or num_swapped_pages else 0.0)


class SimExecutor(Executor):
  """The executor contract over a roofline and a virtual clock."""

  def __init__(self, roofline: Roofline, clock: VirtualClock | PacedClock):
    self.roofline = roofline
    self.clock = clock
    self.costs: list[StepCost] = []

  @property
  def num_compiles(self) -> int:
    return 0

  def warmup(self, max_num_seqs: int, max_num_batched_tokens: int,
             all_greedy: tuple[bool, ...] = (True,), num_decode_steps: int = 1) -> int:
    """Nothing to compile: a priced step has no program."""
    del max_num_seqs, max_num_batched_tokens, all_greedy, num_decode_steps  # Unused.
    return 0

  def submit(self, output: SchedulerOutput) -> Samples:
    """Prices the step and advances the clock by its duration; the ticket is its samples."""
    if output.num_steps > 1:
      return self._run_multi_step(output)
    sequences = [(len(seq.token_ids), seq.start_position + len(seq.token_ids))
                 for seq in output.scheduled]
    cost = self.roofline.step_cost(sequences, len(output.swap_out) + len(output.swap_in),
                                   num_sampled=sum(seq.samples for seq in output.scheduled))
    self.costs.append(cost)
    self.clock.advance(cost.seconds)
    return {seq.request_id: DUMMY_TOKEN for seq in output.scheduled if seq.samples}

  def _run_multi_step(self, output: SchedulerOutput) -> Samples:
    """A multi-step decode, priced iteration by iteration (each a forward pass, with
    its own per-step overhead: the simulator does not model launch savings)."""
    for i in range(max(seq.num_steps for seq in output.scheduled)):
      live = [seq for seq in output.scheduled if seq.num_steps > i]
      cost = self.roofline.step_cost([(1, seq.start_position + 1 + i) for seq in live])
      self.costs.append(cost)
      self.clock.advance(cost.seconds)
    return {seq.request_id: [DUMMY_TOKEN] * seq.num_steps for seq in output.scheduled}

  def collect(self, ticket: Any) -> Samples:
    """The samples `submit` returned: the step already ran on the virtual clock."""
    return ticket
