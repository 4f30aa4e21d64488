"""The admission lines besides the KV watermark, on a clock the test sets and steps of a
known time: the token bucket (exact hints, spent even by requests a later line
refuses, never by a 400), the concurrency limit and the in-flight-token budget (hints
from the forecast end that makes room; a request over the budget on its own is a 400),
the forecast-wait line (a deadline at the door for requests that name none), each off
at 0, and the config check's refusals."""

import pytest

from configs import scheduler as scheduler_lib
from kvpage.host import scheduler_config
from tests.test_retry_estimate import STEP_S, Clock, req, run_steps


def scheduler(**knobs):
  from kvpage.host.scheduler import Scheduler
  config = scheduler_lib.get_scheduler_config()
  config.update({"watermark": 0.0, **knobs})  # 32 usable pages of 4 tokens
  clock = Clock()
  return Scheduler(config, num_pages=33, page_size=4, max_model_len=128, clock=clock), clock


def two_running(**knobs):
  """"a" (40 + 12 tokens) and "z" (4 + 16) after nine steps: "a" ends 3 steps ahead,
  "z" 7 (as in test_retry_estimate)."""
  sched, clock = scheduler(**knobs)
  assert sched.add_request(req("a", 40, 12)).admitted
  assert sched.add_request(req("z", 4, 16)).admitted
  run_steps(sched, clock, 9)
  return sched, clock


def test_the_token_bucket_refuses_past_its_burst_with_an_exact_hint():
  sched, clock = scheduler(rate_limit=2.0, rate_burst=2)
  assert sched.add_request(req("a", 4, 4)).admitted
  assert sched.add_request(req("b", 4, 4)).admitted
  answer = sched.add_request(req("c", 4, 4))
  assert (answer.status, answer.cause) == (429, "rate_limited")
  assert answer.retry_after == pytest.approx(0.5)  # one token at 2/s
  clock.now = 0.25  # half a token: still short, and the hint counts down
  answer = sched.add_request(req("c", 4, 4))
  assert answer.cause == "rate_limited" and answer.retry_after == pytest.approx(0.25)
  clock.now = 0.5
  assert sched.add_request(req("c", 4, 4)).admitted


def test_a_400_spends_no_token_but_a_refusal_behind_the_bucket_does():
  sched, clock = scheduler(rate_limit=1.0, rate_burst=1, max_waiting=1,
                           max_inflight_tokens=100)
  assert sched.add_request(req("bad", 0, 4)).status == 400  # empty prompt
  assert sched.add_request(req("big", 96, 8)).cause == "exceeds_token_budget"
  assert sched.add_request(req("a", 4, 4)).admitted  # the token was still there
  clock.now = 1.0
  answer = sched.add_request(req("b", 4, 4))  # passes the bucket, the queue is full
  assert (answer.status, answer.cause) == (429, "queue_full")
  assert sched.add_request(req("c", 4, 4)).cause == "rate_limited"


def test_the_concurrency_limit_counts_admitted_unfinished_requests():
  sched, clock = two_running(max_concurrent=2)
  answer = sched.add_request(req("b", 4, 4))
  assert (answer.status, answer.cause) == (429, "concurrency_limit")
  # A place opens when "a" ends, 3 steps ahead; the hint is one step late.
  assert answer.retry_after == pytest.approx(3 * STEP_S + STEP_S)
  run_steps(sched, clock, 4)
  assert "a" not in sched.requests
  assert sched.add_request(req("b", 4, 4)).admitted


def test_the_token_budget_weighs_prompt_and_expected_output():
  # In flight: a 40 + 12 = 52, z 4 + 16 = 20; b brings 36 + 8 = 44: 116 > 100.
  sched, _ = two_running(max_inflight_tokens=100)
  answer = sched.add_request(req("b", 36, 8))
  assert (answer.status, answer.cause) == (503, "token_budget")
  assert answer.retry_after == pytest.approx(3 * STEP_S + STEP_S)  # "a" ends: 52 freed
  assert sched.add_request(req("c", 20, 8)).admitted  # 100 exactly fits


def test_the_token_budget_hint_waits_for_enough_ends():
  # The budget tightened to 60 under load: 116 - 60 = 56 tokens must go; "a" frees 52,
  # not enough; "z" (20 more) ends 7 steps ahead.
  sched, _ = two_running()
  sched.config.max_inflight_tokens = 60
  answer = sched.add_request(req("b", 36, 8))
  assert answer.cause == "token_budget"
  assert answer.retry_after == pytest.approx(7 * STEP_S + STEP_S)


def test_a_request_over_the_token_budget_on_its_own_is_a_400():
  sched, _ = scheduler(max_inflight_tokens=30)
  answer = sched.add_request(req("big", 24, 8))
  assert (answer.status, answer.cause) == (400, "exceeds_token_budget")
  # With a running mean the estimate may shrink to the prompt + 1: only that floor
  # counts for the 400; before anything has finished the estimate is max_tokens (32 >
  # 30), and with nothing in flight to end, the request is let in, not told to wait.
  sched, _ = scheduler(max_inflight_tokens=30, output_estimate="running_mean")
  assert sched.add_request(req("big", 24, 8)).admitted
  answer = sched.add_request(req("next", 4, 4))
  assert (answer.status, answer.cause) == (503, "token_budget")


def test_the_forecast_wait_line_refuses_at_the_door_and_a_requests_own_deadline_wins():
  # Two sequences at most: a third waits until "a" ends, 3 steps (0.3 s) ahead.
  sched, _ = two_running(max_num_seqs=2)
  sched.config.max_forecast_ttft_s = 0.2
  answer = sched.add_request(req("b", 4, 4))
  assert (answer.status, answer.cause) == (429, "wait_forecast")
  assert "b" not in sched.requests and not sched.waiting
  own = req("c", 4, 4)
  own.max_queue_wait_s = 1.0  # its own deadline, longer than the server's
  assert sched.add_request(own).admitted
  # "d" waits behind "c" too: until "z" ends, 7 steps ahead (0.73 s with the forecast's
  # own step prices), then its prompt's step (0.125 s): its first token at 0.85 s; a
  # 1 s line lets it in.
  answer = sched.add_request(req("d", 4, 4))
  assert answer.cause == "wait_forecast"
  assert "time to first token 0.850 s" in answer.reason
  sched.config.max_forecast_ttft_s = 1.0
  assert sched.add_request(req("d", 4, 4)).admitted


def test_the_slowdown_line_scales_with_the_requests_own_idle_time_to_first_token():
  # As above, "d" is forecast its first token at 0.85 s; alone on an idle engine its
  # 4-token prompt takes one priced prefill step, 0.125 s: a slowdown of 6.8.
  sched, _ = two_running(max_num_seqs=2)
  own = req("c", 4, 4)
  own.max_queue_wait_s = 1.0
  assert sched.add_request(own).admitted
  assert sched.admission.wait.idle_first_token_s(req("d", 4, 4)) == pytest.approx(0.125)
  sched.config.max_ttft_slowdown = 6.0
  answer = sched.add_request(req("d", 4, 4))
  assert (answer.status, answer.cause) == (429, "wait_forecast")
  assert "max_ttft_slowdown 6 x this request's 125.0 ms on an idle engine" in answer.reason
  sched.config.max_ttft_slowdown = 7.0
  assert sched.add_request(req("d", 4, 4)).admitted
  # Both lines on: the tighter one answers.
  sched.config.max_forecast_ttft_s = 0.5
  answer = sched.add_request(req("e", 4, 4))
  assert answer.cause == "wait_forecast" and "max_forecast_ttft_s 0.5 s" in answer.reason


def test_the_forecast_wait_line_waits_for_a_forecast():
  # Before any step was priced there is no forecast: the line refuses nobody.
  sched, _ = scheduler(max_num_seqs=1, max_forecast_ttft_s=0.01)
  for i in range(3):
    assert sched.add_request(req(f"r{i}", 4, 4)).admitted


def test_every_line_is_off_at_zero():
  sched, _ = two_running()
  for i in range(5):
    assert sched.add_request(req(f"b{i}", 4, 4)).admitted


@pytest.mark.parametrize("knob, value", [("rate_limit", -1.0), ("max_forecast_ttft_s", -0.1),
                                         ("rate_burst", 0), ("max_concurrent", -1),
                                         ("max_inflight_tokens", -5),
                                         ("max_ttft_slowdown", 0.5)])
def test_the_config_check_names_a_bad_line_knob(knob, value):
  config = scheduler_lib.get_scheduler_config()
  config[knob] = value
  with pytest.raises(ValueError, match=f"scheduler.{knob}"):
    scheduler_config.check(config, max_model_len=128)


def test_refused_newcomers_share_one_forecast_and_leave_the_queue_as_it_was(monkeypatch):
  from kvpage.host import forecast, wait_estimate
  sched, _ = two_running(max_num_seqs=2, max_forecast_ttft_s=0.2)
  runs = []
  real = forecast.run
  monkeypatch.setattr(forecast, "run",
                      lambda *a, **k: runs.append(k.get("until")) or real(*a, **k))
  joins = sched._queues().key
  for i in range(5):  # the same shape, the queues unchanged by each refusal
    answer = sched.add_request(req(f"b{i}", 4, 4))
    assert answer.cause == "wait_forecast" and answer.retry_after > 0
  assert runs == [wait_estimate.NEWCOMER]  # one forecast, up to the newcomer's first token
  assert sched._queues().key == joins and not sched.waiting
  assert sched.add_request(req("long", 8, 4)).cause == "wait_forecast"  # another shape
  assert len(runs) == 2


def test_a_prompt_too_long_for_the_wait_line_is_held_to_twice_its_idle_time():
  # "d" is forecast its first token at 0.85 s (as above), 0.125 s alone on an idle
  # engine. A 0.2 s line would refuse it; so would a 0.1 s line, which it cannot meet
  # even alone: that line holds it to 2 x 0.125 s instead, and says so.
  sched, _ = two_running(max_num_seqs=2)
  own = req("c", 4, 4)
  own.max_queue_wait_s = 1.0
  assert sched.add_request(own).admitted
  sched.config.max_forecast_ttft_s = 0.1
  answer = sched.add_request(req("d", 4, 4))
  assert answer.cause == "wait_forecast"
  assert "2 x this request's 125.0 ms on an idle engine" in answer.reason
  assert "too long for the server's max_forecast_ttft_s 0.1 s" in answer.reason
  # Alone on the engine, the same prompt is let in under the same line.
  idle, _ = scheduler(max_num_seqs=2, max_forecast_ttft_s=0.1)
  idle.admission.wait.costs = sched.admission.wait.costs
  assert idle.add_request(req("d", 4, 4)).admitted
