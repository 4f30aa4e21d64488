"""A simulated GPU: a step-cost model of one step, on a virtual clock.

`SimExecutor` runs no model. For each `SchedulerOutput` it prices the step with a
`kvpage.sim.step_model.StepModel` (launch, per-sequence work, the linear layers'
roofline, prefill and decode attention, tensor-parallel all-reduces, swap copies over
the host link; each part at its own calibrated or template rate) and advances a
`VirtualClock` by that many seconds, then emits a dummy token for every sequence that
samples, so requests run to their target length (`max_tokens` with `ignore_eos`). The
scheduler cannot tell it from a real model: this is how the 13B setup runs on a
laptop, in seconds, with the very same policy code that serves real traffic.

A multi-step decode launch is priced iteration by iteration, each a forward pass over
the sequences still live, and pays the launch once. With `buckets` (rates fit on a
kvpage run's padded steps, `StepRates.padded_work`) each step is priced at the shape
kvpage's engine would pad it to, as it was measured.

With `noise` (a seeded `StepNoise`, `--sim_noise`) each step's seconds are multiplied by
a ratio drawn from the calibration's residuals. Each step's priced parts
(`StepModel.named_parts`) wait for the metrics recorder (`step_parts`), so a run's
`steps.jsonl` can be read back part by part.

The simulated device keeps its own timeline, as a GPU's stream does: `submit` queues
a step behind the one in flight (it starts when the device is free, or now if idle)
and returns at once with the time it will end; `collect` waits for it, advancing the
clock to that end. So async scheduling (`Engine(async_scheduling=True)`, the
default) overlaps as on a real device: a request that arrives while step k runs is
scheduled into step k + 2, because step k + 1 was launched before step k's samples
came back. The synchronous loop (`execute`) advances the clock by each step's cost,
one after the other. A step submitted `step_model.IDLE_GAP_S` or more after the device
finished its last one is priced as launched after idle (`StepRates.idle_launch_s`).
Nothing compiles, so `warmup` does nothing and `num_compiles` is 0.
"""

from collections.abc import Callable, Sequence

from kvpage import metrics
from kvpage.batch import Buckets
from kvpage.clock import PacedClock, VirtualClock
from kvpage.interface import CostTraits, Executor, Samples, SchedulerOutput
from kvpage.sim import step_model
from kvpage.sim.step_model import StepCost, StepModel, StepNoise

DUMMY_TOKEN = 1
# Steps whose priced parts wait for the recorder: it reads each as the step returns,
# and no more than two steps are ever in flight.
KEPT_PARTS = 16


class SimExecutor(Executor):
  """The executor contract over a step-cost model and a virtual clock."""

  def __init__(self, model: StepModel, clock: VirtualClock | PacedClock,
               buckets: Buckets | None = None, noise: StepNoise | None = None):
    self.model = model
    self.clock = clock
    self.buckets = buckets  # None: steps are priced unpadded
    self.noise = noise  # None: every step costs exactly its price
    self.costs: list[StepCost] = []
    self._parts: dict[int, dict[str, float]] = {}  # by step, until the recorder reads them
    self._device_free_at = clock()  # when the last submitted step ends
    # As the engine the rates were fit on: its decode rows read to the longest when its
    # steps are priced padded. Fixed with the model and the buckets: made once, not per
    # priced step.
    self._traits = CostTraits(decode_reads_longest=buckets is not None
                              and model.rates.decode_reads_longest)

  @property
  def num_compiles(self) -> int:
    return 0

  @property
  def traits(self) -> CostTraits:
    return self._traits

  def step_parts(self, step: int) -> dict[str, float] | None:
    """The named parts of step `step`'s price (`StepModel.named_parts`, summed over a
    multi-step launch's iterations, with `noise_s` when noise is on); each is handed
    out once."""
    return self._parts.pop(step, None)

  def step_shape(self, output: SchedulerOutput) -> tuple[int, int]:
    """The shape the step is priced at: padded to `buckets` when given."""
    if self.buckets is None or not output.scheduled:
      return super().step_shape(output)
    return self.buckets.padded_shape(output.num_batched_tokens, len(output.scheduled))

  def _price(self, sequences: Sequence[tuple[int, int]], num_swapped_pages: int = 0,
             num_sampled: int | None = None, *, launch: bool = True,
             after_idle: bool = False) -> StepCost:
    """One forward pass over `(new tokens, context)` per sequence, padded if bucketed;
    `after_idle`: launched after the device idled (`step_model.IDLE_GAP_S`)."""
    counts = metrics.step_counts(sequences, num_sampled)
    if self.buckets is not None and counts["num_sequences"]:
      counts = step_model.padded_counts(
          counts, *self.buckets.padded_shape(counts["num_tokens"], counts["num_sequences"]),
          metrics.longest_decode(sequences) if self.traits.decode_reads_longest else None)
    cost = self.model.price(self.model.work_from_counts(
        **counts, num_swapped_pages=num_swapped_pages, after_idle=after_idle), launch=launch)
    self.costs.append(cost)
    return cost

  def warmup(self, max_num_seqs: int, max_num_batched_tokens: int,
             all_greedy: tuple[bool, ...] = (True,), num_decode_steps: int = 1, *,
             progress: Callable[[int, int], None] | None = None,
             logprobs: bool = False) -> int:
    """Nothing to compile: a priced step has no program."""
    del max_num_seqs, max_num_batched_tokens, all_greedy, num_decode_steps  # Unused.
    del progress, logprobs  # Unused.
    return 0

  def measure_steps(self, max_num_seqs: int,
                    max_num_batched_tokens: int) -> list[tuple[int, int, int, float]]:
    """Each warm-up shape priced by the step model as `JaxExecutor.measure_steps` runs
    it (all padding: one-token sequences, no noise); nothing is queued or logged."""
    measured = []
    for num_tokens, num_seqs, _ in (self.buckets or Buckets()).warmup_shapes(
        max_num_seqs, max_num_batched_tokens):
      sizes = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
      work = self.model.work_from_counts(**metrics.step_counts([(n, n) for n in sizes]))
      measured.append((num_tokens, 0, num_seqs, self.model.price(work).seconds))
    return measured

  def submit(self, output: SchedulerOutput) -> tuple[float, Samples]:
    """Prices the step and queues it on the device's timeline, behind the step in
    flight; the ticket is when it ends and its samples."""
    idle = self.clock() - self._device_free_at >= step_model.IDLE_GAP_S
    if output.num_steps > 1:
      costs, samples = self._price_multi_step(output, idle)
    else:
      sequences = [(len(seq.token_ids), seq.start_position + len(seq.token_ids))
                   for seq in output.scheduled]
      costs = [self._price(sequences, len(output.swap_out) + len(output.swap_in),
                           num_sampled=sum(seq.samples for seq in output.scheduled),
                           after_idle=idle)]
      samples = {seq.request_id: DUMMY_TOKEN for seq in output.scheduled if seq.samples}
    parts: dict[str, float] = {}
    for cost in costs:
      for name, value in self.model.named_parts(cost).items():
        parts[name] = parts.get(name, 0.0) + value
    seconds = parts["total_s"]
    if self.noise is not None and seconds > 0:
      parts["noise_s"] = seconds * (self.noise.factor() - 1.0)
      seconds += parts["noise_s"]
      parts["total_s"] = seconds
    self._parts[output.step] = parts
    while len(self._parts) > KEPT_PARTS:  # an engine nobody records for: keep a few
      del self._parts[next(iter(self._parts))]
    self._device_free_at = max(self._device_free_at, self.clock()) + seconds
    return self._device_free_at, samples

  def _price_multi_step(self, output: SchedulerOutput,
                        after_idle: bool) -> tuple[list[StepCost], Samples]:
    """A multi-step decode, priced iteration by iteration (each a forward pass), the
    launch (and any idle launch) paid once; its costs and samples."""
    costs = []
    for i in range(max(seq.num_steps for seq in output.scheduled)):
      live = [seq for seq in output.scheduled if seq.num_steps > i]
      costs.append(self._price([(1, seq.start_position + 1 + i) for seq in live],
                               launch=i == 0, after_idle=after_idle and i == 0))
    return costs, {seq.request_id: [DUMMY_TOKEN] * seq.num_steps
                   for seq in output.scheduled}

  def collect(self, ticket: tuple[float, Samples]) -> Samples:
    """Waits for a submitted step: the clock advances to its end; returns its samples."""
    ends_at, samples = ticket
    self.clock.advance_to(ends_at)
    return samples
