"""Data parallelism on one host: several engines, each with its own pool, stepping at once.

`Replicas` holds `n` engines (each a scheduler, a page pool and an executor of its own,
usually over the same weights) and runs a batch of prompts through all of them at once,
one Python thread per engine. It is the fleet's door in one process: the engines are
ranked by a routing policy of `kvpage.host.routing` (`kv_headroom` by default: the most
room above its KV line after the pages its prompt and `max_tokens` can fill and the
pages already sent to it), and a prompt refused by one engine is offered to the next.
A request never moves: its pages live in its engine's pool, and each engine schedules,
preempts and admits within its own memory line.

Why on a CPU: one engine's step leaves cores idle for part of every decode step:
XLA:CPU runs a step's elementwise operations (and, without the CPU linear kernel, its
products of a few dozen rows) on one core, and the host's work and the attention's
memory reads each leave the arithmetic waiting. Two engines each stepping half the
batch overlap all of it: `benchmarks/dense_cpu.py` measures the dense layers alone,
`benchmarks/decode_cpu.py` the whole generation. Threads suffice because XLA releases
the GIL while it computes; the engines' host work still takes turns on it.

The price is memory's granularity: each engine's pool is its own, so a request can use
only its engine's pages, and one long request cannot borrow another engine's free ones.
`generate` admits every prompt (on its engine) before any engine steps, so a prompt that
no engine takes is refused up front, with its index in the caller's list, and nothing
runs.
Host side: never imports jax.
"""

import itertools
import threading
from collections.abc import Sequence

from kvpage.host import routing
from kvpage.host.engine import Engine
from kvpage.interface import Admission
from kvpage.request import Request, SamplingParams


class Replicas:
  """Engines stepped concurrently, one thread each; prompts routed by `policy`."""

  def __init__(self, engines: Sequence[Engine], policy: str = "kv_headroom"):
    engines = list(engines)
    if not engines:
      raise ValueError("Replicas needs at least one engine")
    if len({id(engine) for engine in engines}) != len(engines):
      raise ValueError("Replicas needs distinct engines: one engine listed twice would "
                       "be stepped from two threads at once")
    self.engines = engines
    self.policy = policy
    routing.Router(policy)  # an unknown policy fails here
    self._ids = itertools.count()  # request ids unique across the engines

  def _router(self) -> routing.Router:
    """A router over a snapshot of every engine now (what is sent next it counts)."""
    router = routing.Router(self.policy)
    router.update([routing.replica_stats(str(index), engine.scheduler)
                   for index, engine in enumerate(self.engines)])
    return router

  def assign(self, prompts: Sequence[Sequence[int]],
             samplings: Sequence[SamplingParams]) -> list[int]:
    """The engine each prompt would go to if each admitted it: the one the policy ranks
    first, counting what was sent before (with `kv_headroom` on equal pools: the fewest
    pages promised, its prompt's tokens plus its `max_tokens`; the first on ties)."""
    router = self._router()
    placement = []
    for prompt, sampling in zip(prompts, samplings, strict=True):
      wanted = routing.RouteRequest(len(prompt), sampling.max_tokens)
      target = router.rank(wanted)[0]
      router.sent(target, wanted)
      placement.append(int(target))
    return placement

  def generate(self, prompts: Sequence[Sequence[int]],
               sampling: SamplingParams | Sequence[SamplingParams]) -> list[Request]:
    """Runs `prompts` to completion across the engines at once; returns their requests in
    the order of `prompts` (outputs inside). Raises `ValueError`, with nothing run, if
    an engine refuses a prompt; re-raises the first error of an engine's loop after
    the others stop."""
    samplings = ([sampling] * len(prompts) if isinstance(sampling, SamplingParams)
                 else list(sampling))
    if len(samplings) != len(prompts):
      raise ValueError(f"{len(prompts)} prompts but {len(samplings)} sampling params")
    router = self._router()
    requests: list[Request] = []
    placement: list[int] = []
    for index, (prompt, params) in enumerate(zip(prompts, samplings)):
      made: dict[str, Request] = {}
      request_id = f"req-{next(self._ids)}"

      def admit(name: str, prompt: Sequence[int] = prompt, params: SamplingParams = params,
                request_id: str = request_id, made: dict[str, Request] = made) -> Admission:
        made[name], answer = self.engines[int(name)].add_request(prompt, params,
                                                                 request_id=request_id)
        return answer

      routed = routing.route(router, routing.RouteRequest(len(prompt), params.max_tokens),
                             admit)
      if routed.replica_id is None:
        for admitted, engine in zip(requests, placement):
          self.engines[engine].abort(admitted.request_id)
        last, answer = routed.tried[-1]
        raise ValueError(f"prompt {index} rejected by replica {last} ({answer.status}): "
                         f"{answer.reason}")
      requests.append(made[routed.replica_id])
      placement.append(int(routed.replica_id))
    errors: list[BaseException | None] = [None] * len(self.engines)

    def run(index: int) -> None:
      try:
        self.engines[index].run_until_done()
      except Exception as error:  # re-raised on the caller's thread below
        errors[index] = error

    busy = sorted(set(placement))
    # Daemons: an interrupt of the caller (Ctrl-C) ends the process without waiting.
    threads = [threading.Thread(target=run, args=(index,), name=f"kvpage-replica-{index}",
                                daemon=True)
               for index in busy[1:]]
    for thread in threads:
      thread.start()
    if busy:
      run(busy[0])  # the caller's thread steps the first engine
    for thread in threads:
      thread.join()
    for error in errors:
      if error is not None:
        raise error
    return requests
