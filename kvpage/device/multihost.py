"""Several processes, one engine: process 0 schedules, every process steps.

A model too big for one host's devices runs over several hosts, one process each
(`jax.distributed`). The mesh (`kvpage.device.sharding`) then spans every process's
devices, and JAX requires every process to launch the same programs, in the same
order, on the same (global) arrays. kvpage keeps its one scheduler: process 0 runs the
`Engine` (admission, scheduling, clients) behind a `Leader`, which sends every call
that launches device work, `submit` and `warmup`, to the other processes before making
it itself. They `follow`: each replays the calls on its own `JaxExecutor`, built from
the same config and weights. The batch each process builds from a `SchedulerOutput` is
the same (`kvpage.batch.build` is deterministic), and the sampled ids come back whole
on every device, so process 0 reads them from its own.

The messages travel over JAX's own collectives (`multihost_utils.broadcast_one_to_all`):
a pickled call, as bytes padded to a power of two so a few compiled broadcasts serve
every size, after its length. Pickle is safe here because the sender is the cluster's
own process 0; never point a follower at an untrusted coordinator.

On CPU, cross-process collectives need an implementation: `initialize` selects gloo.
"""

import pickle
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from kvpage.device.executor import JaxExecutor, Ticket
from kvpage.interface import CostTraits, Executor, Samples, SchedulerOutput

_MIN_MESSAGE_BYTES = 256


def initialize(coordinator_address: str, num_processes: int, process_id: int) -> None:
  """Joins this process to a `num_processes` cluster (before any other use of JAX)."""
  if not 0 <= process_id < num_processes:
    raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id}")
  # CPU devices of different processes talk through gloo; accelerators ignore this.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address, num_processes=num_processes,
                             process_id=process_id)


def is_leader() -> bool:
  """True on the process that schedules: process 0, or the only one."""
  return jax.process_index() == 0


def _broadcast(value: np.ndarray) -> np.ndarray:
  with jax.transfer_guard("allow"):  # an explicit exchange between processes
    return np.asarray(multihost_utils.broadcast_one_to_all(value))


def agree(value: int) -> int:
  """Process 0's `value`, on every process: for a figure each process could compute
  differently (a pool sized from the memory it sees) but all must share."""
  if jax.process_count() == 1:
    return value
  return int(_broadcast(np.array([value], np.int64))[0])


def send(message: Any) -> None:
  """Process 0: sends `message` to every other process (they `receive` it)."""
  payload = np.frombuffer(pickle.dumps(message), np.uint8)
  _broadcast(np.array([payload.size], np.int64))
  padded = np.zeros(max(_MIN_MESSAGE_BYTES, 1 << (payload.size - 1).bit_length()), np.uint8)
  padded[:payload.size] = payload
  _broadcast(padded)


def receive() -> Any:
  """Other processes: the next message process 0 `send`s."""
  size = int(_broadcast(np.zeros(1, np.int64))[0])
  padded = _broadcast(np.zeros(max(_MIN_MESSAGE_BYTES, 1 << (size - 1).bit_length()),
                               np.uint8))
  return pickle.loads(padded[:size].tobytes())


class Leader(Executor):
  """Process 0's executor: each call that launches device work goes to every process."""

  def __init__(self, executor: JaxExecutor, send_fn: Callable[[Any], None] = send):
    self.executor = executor
    self._send = send_fn
    self._stopped = False

  @property
  def page_size(self) -> int:
    return self.executor.page_size

  @property
  def num_compiles(self) -> int:
    return self.executor.num_compiles

  def step_shape(self, output: SchedulerOutput) -> tuple[int, int]:
    return self.executor.step_shape(output)

  @property
  def traits(self) -> CostTraits:
    return self.executor.traits

  def submit(self, output: SchedulerOutput) -> Ticket:
    self._send(("submit", output))
    return self.executor.submit(output)

  def collect(self, ticket: Ticket) -> Samples:
    return self.executor.collect(ticket)

  @property
  def computes_logits(self) -> bool:  # type: ignore[override]
    return self.executor.computes_logits

  def logprobs(self) -> dict[str, Any]:
    return self.executor.logprobs()

  def prompt_logprobs(self) -> dict[str, Any]:
    return self.executor.prompt_logprobs()

  def warmup(self, *args: Any, progress: Any = None, **kwargs: Any) -> int:
    self._send(("warmup", args, kwargs))  # (the followers report no progress)
    return self.executor.warmup(*args, progress=progress, **kwargs)

  def stop(self) -> None:
    """Lets the followers return (once; later calls do nothing)."""
    if not self._stopped:
      self._stopped = True
      self._send(("stop",))

  def __getattr__(self, name: str) -> Any:  # the wrapped executor's other state
    return getattr(self.executor, name)


def follow(executor: JaxExecutor, receive_fn: Callable[[], Any] = receive) -> int:
  """A process other than 0: replays process 0's calls on `executor` until it stops;
  returns the number of steps replayed."""
  steps = 0
  while True:
    message = receive_fn()
    if message[0] == "stop":
      return steps
    if message[0] == "submit":
      executor.submit(message[1])
      steps += 1
    elif message[0] == "warmup":
      executor.warmup(*message[1], **message[2])
    else:
      raise ValueError(f"unknown message from process 0: {message[0]!r}")
