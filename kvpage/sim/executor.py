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
the sequences still live, and pays the launch once.

Under the `Executor` contract a simulated step has no device to wait for: `submit`
runs it (the clock advances then) and its ticket is the samples, which `collect`
hands back; nothing compiles, so `warmup` does nothing and `num_compiles` is 0.
"""

from typing import Any

from kvpage.interface import Executor, Samples, SchedulerOutput
from kvpage.sim.clock import PacedClock, VirtualClock
from kvpage.sim.step_model import StepCost, StepModel

DUMMY_TOKEN = 1


class SimExecutor(Executor):
  """The executor contract over a step-cost model and a virtual clock."""

  def __init__(self, model: StepModel, clock: VirtualClock | PacedClock):
    self.model = model
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
    cost = self.model.step_cost(sequences, len(output.swap_out) + len(output.swap_in),
                                   num_sampled=sum(seq.samples for seq in output.scheduled))
    self.costs.append(cost)
    self.clock.advance(cost.seconds)
    return {seq.request_id: DUMMY_TOKEN for seq in output.scheduled if seq.samples}

  def _run_multi_step(self, output: SchedulerOutput) -> Samples:
    """A multi-step decode, priced iteration by iteration (each a forward pass), the
    launch paid once."""
    for i in range(max(seq.num_steps for seq in output.scheduled)):
      live = [seq for seq in output.scheduled if seq.num_steps > i]
      cost = self.model.step_cost([(1, seq.start_position + 1 + i) for seq in live],
                                  launch=i == 0)
      self.costs.append(cost)
      self.clock.advance(cost.seconds)
    return {seq.request_id: [DUMMY_TOKEN] * seq.num_steps for seq in output.scheduled}

  def collect(self, ticket: Any) -> Samples:
    """The samples `submit` returned: the step already ran on the virtual clock."""
    return ticket
