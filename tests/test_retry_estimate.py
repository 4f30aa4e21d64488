"""The one wait estimator at small scale, on a clock the test sets and steps that take
a known time: a 503's hint is the forecast moment its room opens (one step late, never
early), later clients stand behind earlier ones, a 429's hint is the forecast departure
that leaves a place, a waiting request's ETA (to its first step and to its first token)
comes from the same forecast, nothing is known before a step was priced, the cap holds,
jitter is seeded; and the audit that checks each hint finds the wait really needed,
probing admission without side effects."""

import pytest

from configs import scheduler as scheduler_lib
from kvpage.host import retry_audit
from kvpage.host.retry_audit import RetryAudit
from kvpage.host.scheduler import Scheduler
from kvpage.interface import Admission
from kvpage.request import Request, SamplingParams

STEP_S = 0.1  # every step in these tests takes this long


class Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self) -> float:
    return self.now


def scheduler(**knobs) -> tuple[Scheduler, Clock]:
  config = scheduler_lib.get_scheduler_config()
  config.update({"watermark": 0.25, **knobs})  # 32 usable pages of 4 tokens, 8 kept free
  clock = Clock()
  return Scheduler(config, num_pages=33, page_size=4, max_model_len=128, clock=clock), clock


def req(rid: str, num_prompt: int, max_tokens: int) -> Request:
  return Request(rid, [1] * num_prompt, SamplingParams(max_tokens))


def run_steps(sched: Scheduler, clock: Clock, num_steps: int) -> None:
  for _ in range(num_steps):
    out = sched.schedule()
    clock.now += STEP_S
    sched.update(out, {seq.request_id: 2 for seq in out.scheduled if seq.samples})


def two_running(**knobs) -> tuple[Scheduler, Clock]:
  """"a" (40 + 12 tokens) and "z" (4 + 16) run nine steps: a prefill, then eight
  decodes that teach the cost model a decode step's price. Then "a" holds 12 pages
  with 3 tokens to go, "z" 3 pages with 7 to go; 17 pages are free."""
  sched, clock = scheduler(**knobs)
  assert sched.add_request(req("a", 40, 12)).admitted
  assert sched.add_request(req("z", 4, 16)).admitted
  run_steps(sched, clock, 9)
  assert sched.page_pool.num_free_pages == 17
  return sched, clock


def test_503_hint_is_the_forecast_end_that_opens_room_plus_one_step():
  sched, clock = two_running()
  # 11 pages would leave 6 free, under the 8 kept: room opens when "a" ends, 3 steps
  # ahead (z grows a page by then: 32 - 4 = 28 free, 28 - 11 >= 8).
  answer = sched.add_request(req("b", 36, 8))
  assert answer.status == 503
  assert answer.retry_after == pytest.approx(3 * STEP_S + STEP_S)
  for _ in range(2):  # told 0.4 s: at 0.2 s it would be refused, at 0.4 s it is in
    run_steps(sched, clock, 1)
    assert not sched.admission.admissible(req("b", 36, 8), 0, clock.now)
  run_steps(sched, clock, 2)
  assert sched.add_request(req("b", 36, 8)).admitted


def test_a_later_client_stands_behind_the_first():
  sched, _ = two_running()
  first = sched.add_request(req("b", 36, 8)).retry_after
  # The room "a" leaves is promised to "b": the next one waits for "z" too (4 more
  # steps after "a", all 32 pages free, 32 - 11 - 11 >= 8).
  second = sched.add_request(req("c", 36, 8)).retry_after
  assert first == pytest.approx(4 * STEP_S)
  assert second == pytest.approx(8 * STEP_S)


def test_a_forecast_reused_later_in_the_same_state_counts_the_time_since():
  sched, clock = two_running()
  assert sched.add_request(req("b", 36, 8)).retry_after == pytest.approx(4 * STEP_S)
  clock.now += 0.05  # an arrival in the middle of a step: the forecast is not rerun
  assert sched.add_request(req("c", 36, 8)).retry_after == pytest.approx(8 * STEP_S - 0.05)


def test_429_hint_is_the_forecast_departure_that_leaves_a_place():
  sched, clock = scheduler(max_num_seqs=1, max_waiting=1, watermark=0.0)
  assert sched.add_request(req("a", 8, 10)).admitted
  run_steps(sched, clock, 9)  # "a" has 1 token left; the model knows a decode step
  assert sched.add_request(req("w", 8, 4)).admitted  # waits for the one running seat
  answer = sched.add_request(req("c", 8, 4))
  assert answer.status == 429
  # "a" ends after 1 step; "w" then leaves the queue; the client comes a step later
  # (the forecast's mean step: its prefill is priced by the borrowed fit, up to 25% more).
  assert 2 * STEP_S <= answer.retry_after <= STEP_S + 1.25 * STEP_S
  assert sched.eta("w") == pytest.approx(STEP_S)  # the same forecast
  assert sched.eta("a") == 0.0 and sched.eta("nobody") is None
  # Its first token: the end of its (one-step) prefill, a step after it is scheduled.
  assert sched.eta("w", first_token=True) == pytest.approx(sched.eta("w") + STEP_S, rel=0.25)
  assert sched.eta("a", first_token=True) == 0.0
  assert sched.eta("nobody", first_token=True) is None
  run_steps(sched, clock, 2)
  assert sched.add_request(req("c", 8, 4)).admitted


def test_nothing_priced_yet_gives_the_default_and_the_cap_holds():
  sched, _ = scheduler(default_retry_after_s=1.5)
  assert sched.add_request(req("big", 80, 16)).admitted  # 24 pages: the rest is short
  assert sched.add_request(req("late", 20, 4)).retry_after == 1.5
  capped, _ = two_running(max_retry_after_s=0.25)
  assert capped.add_request(req("b", 36, 8)).retry_after == 0.25


def test_jitter_is_seeded_and_only_stretches():
  exact, _ = two_running()
  base = exact.add_request(req("b", 36, 8)).retry_after
  hints = []
  for _ in range(2):
    sched, _ = two_running(retry_jitter=0.5, retry_jitter_seed=7)
    hints.append([sched.add_request(req(f"b{i}", 36, 8)).retry_after for i in range(4)])
  assert hints[0] == hints[1] and len(set(hints[0])) == 4
  assert base <= hints[0][0] < 1.5 * base


def test_the_kv_line_counts_the_rest_of_a_prompt_being_prefilled_in_chunks():
  """A 64-token prompt one 8-token chunk in holds 2 of its 16 prompt pages: the other 14
  are certain growth, so the door counts them, and its answer does not change when the
  prefill completes (before, it admitted a request the growth then squeezed out)."""
  sched, clock = scheduler(chunk_size=8, max_num_batched_tokens=8)
  assert sched.add_request(req("long", 64, 4)).admitted
  run_steps(sched, clock, 1)
  assert sched.page_pool.num_free_pages == 30 and sched.admission.num_backlog_pages == 0
  answer = sched.add_request(req("b", 32, 4))  # 9 pages: 30 - 9 >= 8, but 30 - 14 - 9 < 8
  assert (answer.status, answer.cause) == (503, "kv_pressure")
  assert "14 for the rest of running prompts" in answer.reason
  assert sched.add_request(req("c", 28, 4)).admitted  # 8 pages: 30 - 14 - 8 = 8 kept
  sched.abort("c")
  run_steps(sched, clock, 7)  # the prompt is in: the door's arithmetic is the same
  assert sched.page_pool.num_free_pages == 16
  assert not sched.admission.admissible(req("b", 32, 4), 0, clock.now, sched.running)
  assert sched.admission.admissible(req("c", 28, 4), 0, clock.now, sched.running)


def test_the_forecast_room_counts_the_rest_of_running_prompts():
  from kvpage.host import forecast
  rules = forecast.Rules(max_num_batched_tokens=8, chunk_size=8, max_num_seqs=4, chunked=True,
                         page_size=4, watermark_pages=0.0, decode_costs=(STEP_S, 0, 0, 0),
                         prefill_costs=(STEP_S, 0, 0, 0), horizon_s=60.0)
  running = [forecast.Job("long", prefill=56, samples_left=4, computed=8, pages=2, estimate=0)]
  timeline = forecast.run(rules, 30, running, [], [])
  assert timeline.rooms[0] == 30 - 14
  assert set(timeline.rooms[:8]) == {16}  # each chunk trades an owed page for a held one
  assert timeline.rooms[-1] == 32  # it ended: every page is back


def test_a_probe_answers_as_admission_would_and_changes_nothing():
  sched, _ = two_running(rate_limit=100.0, rate_burst=5, max_waiting=4,
                             retry_reservations=True)
  big, small = req("b", 36, 8), req("s", 4, 4)
  before = (dict(sched.admission.wait.reservations), sched.admission._bucket,
            sched.stats()["rejections"], len(sched.waiting))
  assert not sched.would_admit(big) and sched.would_admit(small)
  after = (dict(sched.admission.wait.reservations), sched.admission._bucket,
           sched.stats()["rejections"], len(sched.waiting))
  assert after == before  # no reservation, no rate token, no rejection, nothing queued
  assert big.status is small.status and big.arrival_time is None
  assert sched.add_request(small).admitted and not sched.add_request(big).admitted
  assert sched.admission.wait.reservations  # the real refusal holds its pages


def test_the_audit_finds_the_wait_a_refusal_really_needed():
  sched, clock = two_running(retry_audit=8)
  answer = sched.add_request(req("b", 36, 8))
  assert answer.status == 503 and sched.audit.num_open == 1
  refused_at = clock.now
  while sched.audit.num_open:
    run_steps(sched, clock, 1)
  (verdict,) = sched.audit.take()
  # Room opens when "a" ends, 3 steps on; the hint is one step later than that.
  assert verdict.reason == "kv_pressure" and verdict.hint_s == answer.retry_after
  assert verdict.needed_s == pytest.approx(clock.now - refused_at) == pytest.approx(3 * STEP_S)
  assert verdict.ratio == pytest.approx(4 / 3)
  assert sched.audit.take() == []  # each verdict is handed out once
  assert sched.add_request(req("b", 36, 8)).admitted  # the probe said so, and it is


def test_the_audit_is_bounded_and_ends_a_watch_that_never_resolves():
  sched, clock = two_running(retry_audit=1, max_retry_after_s=0.05)
  assert sched.add_request(req("b", 36, 8)).status == 503
  assert sched.add_request(req("c", 36, 8)).status == 503
  assert sched.audit.num_open == 1 and sched.audit.skipped == 1
  # Capped at 0.05 s, "b"'s hint is far too short: watched for at least a second.
  for _ in range(3):
    run_steps(sched, clock, 1)
  assert sched.audit.take()[0].needed_s == pytest.approx(3 * STEP_S)
  never, clock = scheduler(retry_audit=1)
  assert never.add_request(req("x", 100, 20)).status == 400  # no hint: not audited
  assert never.audit.num_open == 0


def test_the_audit_asks_a_refusal_again_only_once_a_share_of_its_hint_has_passed():
  audit = RetryAudit(8)
  request = Request("r", [1] * 4, SamplingParams(4))
  audit.note(request, Admission(503, "full", 1.0, "r", "kv_pressure"), now=0.0)
  asked = []

  def would_admit(probe: Request) -> bool:
    asked.append(probe)
    return now >= 0.5

  now = 0.0
  while audit.num_open:  # a step every millisecond
    now = round(now + 0.001, 6)
    audit.probe(now, would_admit)
  [verdict] = audit.take()
  assert len(asked) <= 0.5 / (retry_audit.RESOLUTION * 1.0) + 1  # not at each of 500 steps
  assert 0.5 <= verdict.needed_s <= 0.5 + retry_audit.RESOLUTION * 1.0 + 1e-9
