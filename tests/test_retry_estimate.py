"""The one wait estimator at small scale, on a clock the test sets: a known free rate
and backlog give the expected hint, a 429 uses the queue's departure rate, hints grow
with the backlog and stand in line behind earlier promises, running requests' ends
forecast the drain, jitter is seeded, and a waiting request's ETA comes from the same
estimator."""

import pytest

from configs import scheduler as scheduler_lib
from kvpage.host.pages import PagePool
from kvpage.host.request import Request, SamplingParams
from kvpage.host.scheduler import Scheduler
from kvpage.host.wait_estimate import WaitEstimator


class Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self) -> float:
    return self.now


def estimator(**knobs) -> WaitEstimator:
  config = scheduler_lib.get_scheduler_config()
  config.update(knobs)
  return WaitEstimator(config, PagePool(65, 4))


def scheduler(**knobs) -> tuple[Scheduler, Clock]:
  config = scheduler_lib.get_scheduler_config()
  config.update(knobs)
  clock = Clock()
  return Scheduler(config, num_pages=33, page_size=4, max_model_len=128, clock=clock), clock


def req(rid: str, num_prompt: int, max_tokens: int) -> Request:
  return Request(rid, [1] * num_prompt, SamplingParams(max_tokens))


def test_503_hint_is_pages_short_over_the_free_rate_behind_earlier_promises():
  wait = estimator(retry_after_window_s=10.0)
  wait.record_free(20, now=1.0)  # 20 pages in a 10 s window: 2 pages/s
  assert wait.retry_after_pages(6, num_pages=8, now=2.0) == pytest.approx(3.0)
  # The next client stands behind the 8 pages promised to the first, due at t = 5.
  assert wait.retry_after_pages(6, num_pages=8, now=2.0) == pytest.approx(7.0)
  # Once the first promise is due, it no longer counts.
  assert wait.retry_after_pages(6, num_pages=8, now=5.5) == pytest.approx(3.0 + 4.0)


def test_429_hint_uses_the_queue_departure_rate():
  wait = estimator(retry_after_window_s=10.0)
  wait.record_free(1000, now=0.0)  # a fast page rate must not leak into a 429
  for t in (1.0, 2.0, 3.0, 4.0):
    wait.record_departure(t)  # 4 departures in 10 s: 0.4 requests/s
  assert wait.retry_after_slots(1, now=5.0) == pytest.approx(2.5)
  assert wait.retry_after_slots(1, now=5.0) == pytest.approx(5.0)  # behind the first


def test_nothing_drained_yet_gives_the_default_and_the_cap_holds():
  wait = estimator(default_retry_after_s=1.5, max_retry_after_s=4.0)
  assert wait.retry_after_pages(10, num_pages=1, now=0.0) == 1.5
  wait.record_free(1, now=0.0)  # 0.1 page/s: 100 s, capped
  assert wait.retry_after_pages(10, num_pages=1, now=0.0) == 4.0


def test_running_requests_ends_forecast_the_drain():
  wait = estimator()
  for t in (0.0, 0.1, 0.2):
    wait.record_step(t)  # 0.1 s a step
  # Two running requests past their prompts: 3 and 10 tokens left; 8 + 4 = 12 tokens
  # = 3 pages and 20 + 18 = 38 tokens = 10 pages at their end.
  a, b = req("a", 8, 4), req("b", 20, 18)
  a.num_computed_tokens, a.output_ids = 8, [1]
  b.num_computed_tokens, b.output_ids = 20, [1] * 8
  assert wait.drain_forecast([b, a], key=1, now=0.2) == [(pytest.approx(0.3), 3),
                                                         (pytest.approx(1.0), 10)]
  assert wait.retry_after_pages(2, 4, 0.2, [b, a], key=1) == pytest.approx(0.3)  # a's end
  # 4 more pages wait for b's end (and the 4 promised to the first client are due
  # before it, so they are drained first).
  assert wait.retry_after_pages(4, 1, 0.2, [b, a], key=1) == pytest.approx(1.0)


def test_hint_grows_with_the_admitted_backlog():
  hints = []
  for backlog in (0, 1, 2):
    sched, clock = scheduler(watermark=0.25)  # 32 usable pages, 8 kept free
    assert sched.add_request(req("hold", 40, 24)).admitted  # 10 pages once prefilled
    assert sched.add_request(req("gone", 20, 4)).admitted  # 5 pages once prefilled
    sched.schedule()
    clock.now = 1.0
    sched.abort("gone")  # 5 pages back in the 10 s window: 0.5 page/s; 22 free
    for i in range(backlog):
      assert sched.add_request(req(f"w{i}", 8, 8)).admitted  # 4 pages each
    answer = sched.add_request(req("late", 40, 24))  # 16 pages: left 22 - 4b - 16
    assert answer.status == 503
    hints.append(answer.retry_after)
  # Short of the line by 8 - (6 - 4b) = 2 + 4b pages, at 0.5 page/s.
  assert hints == pytest.approx([4.0, 12.0, 20.0])


def test_jitter_is_seeded_and_only_stretches():
  exact = estimator()
  exact.record_free(10, now=0.0)
  base = exact.retry_after_pages(5, num_pages=0, now=0.0)
  hints = []
  for _ in range(2):
    wait = estimator(retry_jitter=0.5, retry_jitter_seed=7)
    wait.record_free(10, now=0.0)
    hints.append([wait.retry_after_pages(5, num_pages=0, now=0.0) for _ in range(5)])
  assert hints[0] == hints[1] and len(set(hints[0])) == 5
  assert all(base <= h < 1.5 * base for h in hints[0])


def test_eta_of_a_waiting_request_comes_from_the_same_estimator():
  sched, clock = scheduler(watermark=0.0, max_num_seqs=1)
  assert sched.add_request(req("run", 8, 4)).admitted
  sched.schedule()  # "run" departs the queue at t = 0 and holds 2 pages
  assert sched.eta("run") == 0.0 and sched.eta("nobody") is None
  for i in range(3):
    assert sched.add_request(req(f"w{i}", 8, 4)).admitted
  clock.now = 5.0  # one departure in the 10 s window: 0.1 requests/s
  assert sched.eta("w0") == pytest.approx(0.0)  # head of the line, pages free
  assert sched.eta("w1") == pytest.approx(10.0)  # one departure ahead of it
  assert sched.eta("w2") == pytest.approx(20.0)
