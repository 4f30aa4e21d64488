"""Reservations (`scheduler.retry_reservations`) at small scale, on a clock the test
sets: a 503'd request holds its pages, so a newcomer cannot take them and the client
returning with its id is admitted; a reservation lapses after its grace period; a
client refused on return by another line (its own deadline) keeps its place."""

import pytest

from configs import scheduler as scheduler_lib
from kvpage.host.scheduler import Scheduler
from kvpage.host.wait_estimate import FIRST_TOKEN_PLACE_LATE_S, LINE_MARGIN
from kvpage.request import Request, SamplingParams


class Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self) -> float:
    return self.now


def scheduler(**knobs) -> tuple[Scheduler, Clock]:
  config = scheduler_lib.get_scheduler_config()
  config.update({"watermark": 0.25, "retry_reservations": True, **knobs})
  clock = Clock()
  return Scheduler(config, num_pages=33, page_size=4, max_model_len=128, clock=clock), clock


def req(rid: str, num_prompt: int, max_tokens: int) -> Request:
  return Request(rid, [1] * num_prompt, SamplingParams(max_tokens))


def fill_then_free(sched: Scheduler, clock: Clock) -> None:
  """32 usable pages, 8 kept free: "hold" prefills 16 pages, "gone" 1, leaving 15
  free, 7 above the line: too few for an 8-page request until "gone" ends."""
  assert sched.add_request(req("hold", 64, 24)).admitted
  assert sched.add_request(req("gone", 4, 4)).admitted
  sched.schedule()
  clock.now = 1.0


def test_a_promised_client_returning_is_admitted_ahead_of_a_newcomer():
  sched, clock = scheduler()
  fill_then_free(sched, clock)
  promised = sched.add_request(req("client", 20, 12))  # 8 pages: 1 short of the line
  assert promised.status == 503 and promised.retry_after > 0
  sched.abort("gone")  # 1 page back: room for one 8-page request
  newcomer = sched.add_request(req("newcomer", 20, 12))
  assert newcomer.status == 503 and "reserved" in newcomer.reason
  clock.now += promised.retry_after
  assert sched.add_request(req("client", 20, 12)).admitted  # against its reservation
  assert not sched.admission.wait.reservations.get("client")
  # The newcomer's hint stands behind the client's: it holds its own reservation now.
  assert "newcomer" in sched.admission.wait.reservations


def test_a_lapsed_reservation_frees_its_room():
  sched, clock = scheduler(retry_grace_s=0.5)
  fill_then_free(sched, clock)
  promised = sched.add_request(req("client", 20, 12))
  assert promised.status == 503
  sched.abort("gone")
  clock.now += promised.retry_after + 0.6  # the client never came back in time
  assert sched.add_request(req("newcomer", 20, 12)).admitted
  assert "client" not in sched.admission.wait.reservations


def test_off_by_default_a_newcomer_takes_the_room():
  config = scheduler_lib.get_scheduler_config()
  assert config.retry_reservations is False
  sched, clock = scheduler(retry_reservations=False)
  fill_then_free(sched, clock)
  assert sched.add_request(req("client", 20, 12)).status == 503
  sched.abort("gone")
  assert sched.add_request(req("newcomer", 20, 12)).admitted


def test_a_client_the_deadline_check_refuses_keeps_its_place():
  sched, clock = scheduler()
  fill_then_free(sched, clock)
  promised = sched.add_request(req("client", 20, 12))
  assert promised.status == 503
  rank = sched.admission.wait.reservations["client"].rank
  sched.abort("gone")
  clock.now += promised.retry_after
  # Its pages are there, but it reached the gateway a second ago and will wait half
  # of one: refused by its own deadline, not by the cache.
  hurried = Request("client", [1] * 20, SamplingParams(12), max_queue_wait_s=0.5)
  hurried.arrival_time = clock.now - 1.0
  answer = sched.add_request(hurried)
  assert answer.cause == "wait_deadline"
  assert sched.admission.wait.reservations["client"].rank == rank  # still first in line
  assert sched.add_request(req("client", 20, 12)).admitted


def test_a_place_is_ahead_of_another_by_when_it_is_due_not_by_rank():
  sched, clock = scheduler()
  fill_then_free(sched, clock)
  first = sched.add_request(req("first", 20, 12))
  second = sched.add_request(req("second", 20, 12))
  assert first.status == second.status == 503
  wait = sched.admission.wait
  assert wait.ahead("second", clock.now).places == 1
  # "first" told to come back after "second" (say, refused again on return): it no
  # longer stands in the way of "second", and "second" stands in its way.
  held = wait.reservations["first"]
  held.due = wait.reservations["second"].due + 1.0
  held.expires = held.due + 1.0
  wait._line_version += 1  # what a renewal does
  assert wait.ahead("second", clock.now).places == 0
  assert wait.ahead("first", clock.now).places == 1
  assert wait.ahead("newcomer", clock.now).places == 2  # a newcomer: behind them all


def test_a_turn_past_the_cap_is_told_the_cap_and_back_early_the_rest():
  sched, clock = scheduler(max_retry_after_s=0.05)
  fill_then_free(sched, clock)
  for _ in range(3):  # priced steps: the forecast runs
    sched.update(sched.schedule(), {"hold": 2, "gone": 2})
    clock.now += 0.01
  answer = sched.add_request(req("client", 20, 12))
  assert answer.status == 503 and answer.retry_after == 0.05  # the cap
  due = sched.admission.wait.reservations["client"].due
  assert due > clock.now + 0.05  # its place stays due at its turn
  clock.now += answer.retry_after
  again = sched.add_request(req("client", 20, 12))
  assert again.status == 503
  assert sched.admission.wait.reservations["client"].due >= due - 1e-9


def test_a_newcomer_only_the_ttft_line_refuses_waits_for_the_queue_not_the_line():
  """Its pages fit past every place, so its hint is when the queue it met has drained
  enough, not when the line's last place is due (100 s away here)."""
  sched, clock = scheduler(max_forecast_ttft_s=0.03, max_num_seqs=2)
  fill_then_free(sched, clock)
  for _ in range(3):  # priced steps (0.01 s each): the forecast runs
    sched.update(sched.schedule(), {"hold": 2, "gone": 2})
    clock.now += 0.01
  assert sched.add_request(req("client", 20, 12)).status == 503  # a place in line...
  wait = sched.admission.wait
  held = wait.reservations["client"]
  held.turn, held.due = clock.now + 100.0, clock.now + 100.0  # ...due far away
  held.expires = held.due + 1.0
  wait._line_version += 1
  sched.abort("hold")  # room for everyone now
  queued = [sched.add_request(req(f"queued{i}", 4, 2)) for i in range(6)]
  answer = sched.add_request(req("newcomer", 4, 2))
  assert queued[0].admitted  # (later ones meet the forecast-TTFT line too)
  assert answer.cause == "wait_forecast", answer
  assert 0 < answer.retry_after < 1.0


def test_a_holder_only_the_ttft_line_refuses_is_not_queued_behind_ghost_places():
  """A holder back on time, its pages there, refused by the forecast-TTFT line alone:
  its hint is when the queue drains, not behind places ranked ahead of it whose
  holders never came back (due already, not yet lapsed)."""
  sched, clock = scheduler(max_num_seqs=2, retry_grace_s=60.0)
  fill_then_free(sched, clock)
  for _ in range(3):  # priced steps (0.01 s each): the forecast runs
    sched.update(sched.schedule(), {"hold": 2, "gone": 2})
    clock.now += 0.01
  sched.abort("hold")  # room for every place below
  for index in range(4):
    assert sched.add_request(req(f"queued{index}", 4, 2)).admitted
  sched.admission.config.max_waiting = 4  # the waiting queue is full now
  wait = sched.admission.wait
  names = [f"ghost{i}" for i in range(6)] + ["client"]
  for name in names:  # refused in this order (429: the queue), two pages each
    assert sched.add_request(req(name, 4, 4)).cause == "queue_full"
  for name in names:  # all due now: nobody came back but the client
    held = wait.reservations[name]
    held.turn = held.due = clock.now
    held.expires = clock.now + 60.0
  wait._line_version += 1
  sched.admission.config.max_waiting = 0  # (room in the queue for the client now)
  sched.config.max_forecast_ttft_s = 0.03  # and a forecast-TTFT line it is past
  answer = sched.add_request(req("client", 4, 4))
  assert answer.cause == "wait_forecast", answer
  # Six ghosts ahead of it, two at a time, five steps each, would take 0.15 s and more.
  assert 0 < answer.retry_after < 0.1, answer


def test_a_burst_the_ttft_line_refuses_is_told_turns_one_behind_the_other():
  """Newcomers refused by the forecast-TTFT line alone are told turns one behind the
  other (they do not come back together to room for a few), behind no place whose
  holder is late. Their hints add no step: the line takes a holder back on time a
  step late."""
  sched, clock = scheduler(max_forecast_ttft_s=0.03, max_num_seqs=2, retry_jitter=0.0)
  fill_then_free(sched, clock)
  for _ in range(3):  # priced steps (0.01 s each): the forecast runs
    sched.update(sched.schedule(), {"hold": 2, "gone": 2})
    clock.now += 0.01
  sched.abort("hold")  # room for everyone's pages
  queued = [sched.add_request(req(f"queued{i}", 4, 2)) for i in range(4)]
  assert queued[0].admitted  # (later ones meet the forecast-TTFT line too)
  wait = sched.admission.wait
  answers = {}
  for name in ("first", "second"):
    answers[name] = sched.add_request(req(name, 4, 2))
    assert answers[name].cause == "wait_forecast", answers[name]
  first, second = (wait.reservations[name] for name in ("first", "second"))
  assert first.first_token_line and second.first_token_line
  assert second.turn > first.turn  # behind the first one's prefill
  for held, answer in ((first, answers["first"]), (second, answers["second"])):
    turn = held.turn - clock.now
    assert answer.retry_after == pytest.approx(turn * (1 + LINE_MARGIN))  # no step added
  # A newcomer refused now would stand behind all four ("queued2" and "queued3" were
  # refused too); once none came back by its hint and margin, behind none of them.
  assert len(wait._first_token_places("third", clock.now)) == 4
  clock.now = max(held.due + max(held.due - held.turn, FIRST_TOKEN_PLACE_LATE_S)
                  for held in wait.reservations.values()) + 1e-6
  assert wait._first_token_places("third", clock.now) == []


def test_a_holder_first_refused_for_pages_keeps_its_place_for_pages():
  """Back with its pages there and refused by the forecast-TTFT line alone, a holder
  refused for pages first keeps its place, and its due, as one for pages: no later
  refusal by the TTFT line is told its turn behind it."""
  sched, clock = scheduler(max_num_seqs=2, retry_grace_s=60.0)
  fill_then_free(sched, clock)
  for _ in range(3):  # priced steps (0.01 s each): the forecast runs
    sched.update(sched.schedule(), {"hold": 2, "gone": 2})
    clock.now += 0.01
  assert sched.add_request(req("client", 20, 12)).status == 503  # for pages
  due = sched.admission.wait.reservations["client"].due
  sched.abort("hold")  # its pages are there now
  for index in range(4):
    assert sched.add_request(req(f"queued{index}", 4, 2)).admitted
  sched.config.max_forecast_ttft_s = 0.03  # a forecast-TTFT line it is past
  clock.now = due  # back on time
  answer = sched.add_request(req("client", 20, 12))
  assert answer.cause == "wait_forecast", answer
  held = sched.admission.wait.reservations["client"]
  assert not held.first_token_line
  assert held.due == due  # where it stood in line (told to come back a little later)
  assert held.expires == pytest.approx(clock.now + answer.retry_after
                                       + sched.admission.wait.grace_s)
  assert sched.admission.wait._first_token_places("newcomer", clock.now) == []


def test_a_turn_for_a_place_in_the_queue_adds_a_share_of_a_step_not_a_step():
  """Refused because the waiting queue is full, a request's turn is when a step
  launches and takes one of the waiting: often the rest of the step in flight. Its hint
  adds half its turn or a quarter of a step, whichever is more, not a whole step."""
  sched, clock = scheduler(max_num_seqs=2, max_waiting=4, retry_jitter=0.0)
  fill_then_free(sched, clock)
  for _ in range(3):  # priced steps (0.01 s each): the forecast runs
    sched.update(sched.schedule(), {"hold": 2, "gone": 2})
    clock.now += 0.01
  sched.abort("hold")
  for index in range(4):
    assert sched.add_request(req(f"queued{index}", 4, 4)).admitted
  answer = sched.add_request(req("client", 4, 4))
  assert answer.cause == "queue_full", answer
  turn = sched.admission.wait.reservations["client"].turn - clock.now
  step = 0.01  # what every step here took
  assert answer.retry_after == pytest.approx(turn + max(LINE_MARGIN * turn, step / 4),
                                             rel=0.2)
  assert answer.retry_after < turn + step
