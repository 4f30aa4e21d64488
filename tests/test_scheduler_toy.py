"""The seed's toy setting, worked through: 100 pages of 16 tokens, a waiting queue of 3,
ten requests of 200 prompt + 50 output tokens submitted at once.

Arithmetic (default knobs: watermark 15%, output estimate = max_tokens, chunked prefill
with a 2,048-token budget):
  * 100 pages include the null page, so 99 pages = 1,584 tokens can be handed out, and
    the watermark keeps 0.15 x 99 = 14.85 pages free after every admission.
  * One request is estimated at ceil((200 + 50) / 16) = 16 pages. Its cache peaks at
    249 tokens (the 50th output token is sampled, never fed back) = 16 pages.
  * r0, r1, r2 are admitted: afterwards 99 - 3 x 16 = 51 pages stay free.
  * r3 would still leave 99 - 4 x 16 = 35 >= 14.85 free pages, so the cache could take
    it, but three requests already wait: r3..r9 all get 429 (queue full).
  * The three admitted requests prefill together in step 1 (600 tokens <= 2,048; 13
    pages each), decode 49 more steps, and finish by length with 50 tokens each at step
    50. Their peak is 48 pages (48%): no preemption, and every page is free at the end.
"""

import pytest

from configs import scheduler as scheduler_config
from kvpage.host.scheduler import Scheduler
from kvpage.request import Request, RequestStatus, SamplingParams

NUM_PAGES, PAGE_SIZE, PROMPT, OUTPUT = 100, 16, 200, 50


class StepClock:
  """Virtual seconds: `run_to_completion` advances it by 20 ms per step."""

  def __init__(self):
    self.now = 0.0

  def __call__(self) -> float:
    return self.now


def toy_scheduler(max_waiting: int = 3) -> Scheduler:
  config = scheduler_config.get_scheduler_config()
  config.max_waiting = max_waiting
  return Scheduler(config, num_pages=NUM_PAGES, page_size=PAGE_SIZE, max_model_len=2048,
                   clock=StepClock())


def toy_request(i: int) -> Request:
  return Request(f"r{i}", [100 + i] * PROMPT, SamplingParams(max_tokens=OUTPUT))


def run_to_completion(scheduler: Scheduler) -> tuple[int, int]:
  """Steps of 20 ms until idle, sampling token 1; returns (steps, peak used pages)."""
  steps = peak = 0
  while scheduler.has_unfinished():
    out = scheduler.schedule()
    peak = max(peak, scheduler.page_pool.num_used_pages)
    scheduler.clock.now += 0.02  # the step runs
    scheduler.update(out, {s.request_id: 1 for s in out.scheduled if s.samples})
    steps += 1
    assert not out.preempted and steps <= 100
  return steps, peak


def test_toy_setting_admits_three_and_sends_429_to_seven():
  scheduler = toy_scheduler()
  requests = [toy_request(i) for i in range(10)]
  answers = [scheduler.add_request(r) for r in requests]
  assert [a.status for a in answers] == [200] * 3 + [429] * 7
  assert all("waiting queue full (3 of 3)" in a.reason for a in answers[3:])
  # No step has been priced yet, so retry_after is the configured default.
  assert all(a.retry_after == scheduler.config.default_retry_after_s for a in answers[3:])
  assert all(r.status is RequestStatus.REJECTED for r in requests[3:])
  assert scheduler.admission.num_backlog_pages == 3 * 16

  first = scheduler.schedule()  # all three prompts prefill together
  assert [len(s.token_ids) for s in first.scheduled] == [PROMPT] * 3
  assert scheduler.page_pool.num_used_pages == 3 * 13
  scheduler.update(first, {s.request_id: 1 for s in first.scheduled})
  steps, peak = run_to_completion(scheduler)
  assert steps + 1 == OUTPUT and peak == 3 * 16
  for r in requests[:3]:
    assert (r.finish_reason, r.num_output_tokens, r.num_preemptions) == ("length", OUTPUT, 0)
    assert r.event_kinds() == ["queued", "admitted", "scheduled", "first_token", "finished"]
  bm = scheduler.page_pool
  assert bm.num_free_pages == bm.num_usable_pages == 99
  # Retrying after they finished: the queue has room again, three more get in.
  retries = [scheduler.add_request(toy_request(i)) for i in range(3, 10)]
  assert [a.status for a in retries] == [200] * 3 + [429] * 4


def test_toy_setting_with_a_longer_queue_hits_the_watermark_instead():
  """With room for ten in the queue, the cache line binds first: five requests x 16
  pages leave 19 free pages; a sixth would leave 3 < 14.85, so r5..r9 get 503."""
  scheduler = toy_scheduler(max_waiting=10)
  answers = [scheduler.add_request(toy_request(i)) for i in range(10)]
  assert [a.status for a in answers] == [200] * 5 + [503] * 5
  assert "would leave 3 of 99 free pages" in answers[5].reason
  steps, peak = run_to_completion(scheduler)
  assert steps == OUTPUT and peak == 5 * 16  # 81% of the pool at the peak, no preemption
  assert scheduler.stats()["rejections"] == {400: 0, 429: 0, 503: 5}
  # Refill the queue: the next 503 is short 14.85 - 3 pages until the five prefill in
  # one step and their charge drops from 16 estimated pages to the 13 they hold
  # (99 - 65 = 34 >= 14.85 + 16). The step-cost model has seen 20 ms decodes but only
  # one prefill step, so it prices prefill as the cheapest step seen plus 25%: the
  # forecast has room after 25 ms, and the hint adds one mean forecast step.
  # First the five told to come back (at the default 1 s: nothing was priced then) and
  # gone for good leave the line, `retry_grace_s` after their hint; until then they
  # would stand ahead of every newcomer.
  assert len(scheduler.admission.wait.reservations) == 5
  scheduler.clock.now = 1.0 + scheduler.config.retry_grace_s + 0.01
  for i in range(10, 15):
    assert scheduler.add_request(toy_request(i)).admitted
  assert not scheduler.admission.wait.reservations
  late = scheduler.add_request(toy_request(15))
  assert late.status == 503
  assert late.retry_after == pytest.approx(0.025 + (0.025 + 49 * 0.02) / OUTPUT)
  for _ in range(2):  # the steps run 20 ms, not 25: the client, told 45 ms, finds room
    out = scheduler.schedule()
    scheduler.clock.now += 0.02
    scheduler.update(out, {s.request_id: 1 for s in out.scheduled if s.samples})
  assert scheduler.add_request(toy_request(15)).admitted
