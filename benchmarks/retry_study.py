"""The retry-honesty study's measurement, without flags: obedient clients and a probe.

`measure` replays a trace on a simulated device with clients that retry exactly when
told (same tokens, same id, at the answer's time plus its `retry_after`), and after
every step probes, without side effects, whether each rejected request would be
admitted now (`AdmissionControl.admissible`, under its id, so with any reservation it
holds): the first such moment (or its retry's admission, if sooner) is the time after
which a retry would actually have been admitted. `summarize` turns that into the
figures `benchmarks/retry_honesty.py` prints. Flag-free so that tests run the same
study at small scale.
"""

import dataclasses
import statistics

from experiments import cli
from kvpage.interface import Admission
from kvpage.request import Request, SamplingParams
from kvpage.sim import replay, workload


@dataclasses.dataclass
class Rejection:
  """One rejected attempt: when (trace clock), the hint, and what happened after."""

  root: str
  attempt: int
  time: float
  status: int
  hint: float
  actual: float | None = None  # first time after which a retry would have been admitted
  retry_admitted: bool | None = None  # the honoured retry's answer


def setup(config, hardware, num_pages: int = 0):
  config.cache.num_pages = num_pages  # 0: the hardware's memory plan
  return cli.serving_engine(config, executor="sim", hardware=hardware)


def sampling(item: workload.TraceRequest) -> SamplingParams:
  return SamplingParams(max_tokens=item.output_len, ignore_eos=True)


def measure(config, hardware, trace: list[workload.TraceRequest], rate: float, *,
            max_attempts: int, num_pages: int = 0) -> dict:
  """Replays `trace` (offered at `rate`) on the simulated `hardware` with clients that
  retry exactly when told, probing after every step when each rejected request would
  have been admitted; the figures (`summarize`)."""
  engine = setup(config, hardware, num_pages).engine
  scheduler = engine.scheduler
  start = scheduler.clock()
  rejections: list[Rejection] = []
  open_probes: list[tuple[Rejection, Request]] = []
  last: dict[str, Rejection] = {}  # each root's latest rejection, until its next answer
  attempts: dict[str, int] = {}

  def on_submit(request: Request) -> None:
    root = request.request_id
    attempts[root] = attempts.get(root, 0) + 1
    if root in last:  # the answer to an honoured retry
      last.pop(root).retry_admitted = request.status is not request.status.REJECTED
    if request.status is not request.status.REJECTED:  # admitted before a probe saw room
      now = scheduler.clock() - start
      still = []
      for rejection, probe in open_probes:
        if rejection.root == root:
          rejection.actual = now - rejection.time
        else:
          still.append((rejection, probe))
      open_probes[:] = still

  def on_reject(item: workload.TraceRequest, answer: Admission,
                now: float) -> workload.TraceRequest | None:
    root = item.request_id
    rejection = Rejection(root, attempts[root], now, answer.status, answer.retry_after or 0.0)
    rejections.append(rejection)
    probe = Request(item.request_id, list(item.prompt_ids), sampling(item))
    open_probes.append((rejection, probe))
    if attempts[root] >= max_attempts or answer.retry_after is None:
      return None
    last[root] = rejection
    return dataclasses.replace(item, arrival_time=now + answer.retry_after)

  def on_step() -> None:
    clock = scheduler.clock()
    now = clock - start
    still = []
    for rejection, probe in open_probes:
      if scheduler.admission.admissible(probe, scheduler.num_waiting, clock,
                                        scheduler.running):
        rejection.actual = now - rejection.time
      else:
        still.append((rejection, probe))
    open_probes[:] = still

  replay.replay(engine, trace, make_sampling=sampling, on_submit=on_submit, on_step=on_step,
                on_reject=on_reject)
  return summarize(rate, trace, rejections, attempts, scheduler.clock() - start,
                   config.scheduler.max_retry_after_s)


def summarize(rate: float, trace: list, rejections: list[Rejection], attempts: dict[str, int],
              duration: float, max_hint: float) -> dict:
  first = [r for r in rejections if r.attempt == 1 and r.retry_admitted is not None]
  retried = [r for r in rejections if r.retry_admitted is not None]
  ratios = [r.hint / r.actual for r in rejections if r.actual]
  early = [r for r in rejections if r.actual is not None and r.hint < r.actual]
  statuses: dict[str, int] = {}
  for r in rejections:
    statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
  share = (lambda rows: sum(r.retry_admitted for r in rows) / len(rows) if rows else None)
  return dict(
      arrival_rate=rate, num_requests=len(trace), num_rejections=len(rejections),
      rejections=statuses, requests_rejected=len({r.root for r in rejections}),
      first_retry_admitted=share(first), any_retry_admitted=share(retried),
      median_hint_over_actual=statistics.median(ratios) if ratios else None,
      p10_p90_hint_over_actual=(statistics.quantiles(ratios, n=10)[0::8]
                                if len(ratios) >= 2 else None),
      hints_earlier_than_actual=len(early) / len(ratios) if ratios else None,
      median_hint_s=statistics.median([r.hint for r in rejections]) if rejections else None,
      median_actual_s=statistics.median([r.actual for r in rejections if r.actual is not None])
      if ratios else None,
      hints_at_cap=sum(r.hint >= max_hint for r in rejections),
      max_attempts=max(attempts.values()), duration_s=duration)
