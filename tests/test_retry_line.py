"""The line of places (`scheduler.retry_reservations`) under a burst, on a clock the test
sets: every line a refused client can meet at once (the KV watermark, a bounded waiting
queue, a forecast-TTFT line), 150 clients arriving within a tenth of a second, each
coming back exactly when told with the id it was refused under. With the line, nearly
every first retry is admitted and the burst is served sooner than without it; without
it, most first retries are refused again (the test can tell the two apart). The
audit's hint / needed is checked too, but with places held it cannot catch a long hint
on its own (the room a holder ahead was promised idles until it returns, stretching
the wait the next one needs: `tests/test_retry_honesty.py`); the time the burst takes
is what shows the hints are not long."""

import collections
import heapq
import statistics

import pytest

from configs import scheduler as scheduler_lib
from kvpage.host.scheduler import Scheduler
from kvpage.request import Request, SamplingParams

DECODE_S, PREFILL_S = 0.004, 0.006  # what a step takes here
NUM_CLIENTS, SPACING_S = 150, 0.0007
PROMPT, OUTPUT = 32, 16  # tokens: 3 pages of 16 each, of 48


class Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self) -> float:
    return self.now


def step(sched: Scheduler, clock: Clock) -> None:
  out = sched.schedule()
  clock.now += PREFILL_S if out.num_batched_tokens > len(out.scheduled) else DECODE_S
  sched.update(out, {seq.request_id: 2 for seq in out.scheduled if seq.samples})


def burst(reservations: bool) -> dict:
  """The burst's figures: first retries admitted (by the first refusal's reason), the
  audit's hint / needed, attempts per client, and the time to serve them all."""
  config = scheduler_lib.get_scheduler_config()
  config.update(dict(watermark=0.4, max_num_seqs=8, max_num_batched_tokens=256, max_waiting=4,
                     max_forecast_ttft_s=0.05, retry_jitter=0.25, retry_audit=512,
                     retry_reservations=reservations))
  clock = Clock()
  sched = Scheduler(config, num_pages=49, page_size=16, max_model_len=512, clock=clock)
  for index in range(3):  # steps of both kinds, priced
    assert sched.add_request(Request(f"warm-{index}", [1] * PROMPT, SamplingParams(OUTPUT)))
  while sched.has_unfinished():
    step(sched, clock)
  start = clock.now
  arrivals = [(start + index * SPACING_S, index, 0) for index in range(NUM_CLIENTS)]
  first_refusal: dict[int, str] = {}
  retried: dict[str, list[bool]] = collections.defaultdict(list)
  attempts: dict[int, int] = {}
  while arrivals or sched.has_unfinished():
    while arrivals and arrivals[0][0] <= clock.now:
      _, index, tries = heapq.heappop(arrivals)
      answer = sched.add_request(Request(f"client-{index}", [1] * PROMPT,
                                         SamplingParams(OUTPUT)))
      attempts[index] = tries + 1
      if tries == 1:
        retried[first_refusal[index]].append(answer.admitted)
      if not answer.admitted:
        assert answer.retry_after is not None and tries < 20, answer
        first_refusal.setdefault(index, answer.cause)
        heapq.heappush(arrivals, (clock.now + answer.retry_after, index, tries + 1))
    if sched.has_unfinished():
      step(sched, clock)
    elif arrivals:
      clock.now = arrivals[0][0]
  verdicts = sched.audit.take()
  assert verdicts and all(v.needed_s is not None for v in verdicts)
  return dict(retried=retried, attempts=attempts, wall_s=clock.now - start,
              ratio=statistics.median(v.ratio for v in verdicts),
              reasons=collections.Counter(v.reason for v in verdicts))


@pytest.fixture(scope="module")
def line() -> dict:
  return burst(reservations=True)


def test_first_retries_are_admitted_and_the_hints_are_close(line):
  assert set(line["reasons"]) >= {"kv_pressure", "queue_full"}  # more than one line said no
  first = [admitted for results in line["retried"].values() for admitted in results]
  assert len(first) >= 100 and sum(first) / len(first) >= 0.8
  kv = line["retried"]["kv_pressure"]
  assert sum(kv) / len(kv) >= 0.8
  assert 1.0 <= line["ratio"] <= 2.0  # never early in the median, and not idling
  assert len(line["attempts"]) == NUM_CLIENTS  # every client served


def test_without_the_line_the_same_burst_fails_and_takes_longer(line):
  ledger = burst(reservations=False)
  first = [admitted for results in ledger["retried"].values() for admitted in results]
  assert sum(first) / len(first) < 0.8
  assert line["wall_s"] < ledger["wall_s"]
