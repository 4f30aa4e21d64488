"""Scheduler unit tests: each admission answer at its boundary, victim choice, swap
round trips, decode-first vs prefill-first order, aborts in every state, config checks."""

import pytest

from configs import llama_13b, tiny
from configs import scheduler as scheduler_config
from kvpage.host import scheduler_config as policy
from kvpage.host.scheduler import Scheduler
from kvpage.request import Request, RequestStatus, SamplingParams


class FakeClock:
  def __init__(self):
    self.now = 0.0

  def __call__(self) -> float:
    return self.now


def make(num_pages=100, page_size=16, max_model_len=4096, num_host_pages=None, **knobs):
  config = scheduler_config.get_scheduler_config()
  config.update(knobs)
  clock = FakeClock()
  return Scheduler(config, num_pages=num_pages, page_size=page_size,
                   max_model_len=max_model_len, num_host_pages=num_host_pages,
                   clock=clock), clock


def req(rid, num_prompt, max_tokens, priority=0, **sampling):
  return Request(rid, list(range(1, num_prompt + 1)), SamplingParams(max_tokens, **sampling),
                 priority=priority)


def step(scheduler, token=7):
  out = scheduler.schedule()
  finished = scheduler.update(out, {s.request_id: token for s in out.scheduled if s.samples})
  return out, finished


# Admission: 400.
def test_400_at_the_max_model_len_boundary():
  scheduler, _ = make(max_model_len=256, watermark=0.0)
  assert scheduler.add_request(req("fits", 200, 56)).admitted  # 256 = max_model_len
  answer = scheduler.add_request(req("over", 200, 57))
  assert answer.status == 400 and "exceeds max_model_len 256" in answer.reason
  assert answer.retry_after is None  # retrying cannot help


def test_400_at_the_whole_pool_boundary():
  # 99 usable pages of 16 tokens = 1,584 tokens; watermark 0 so only the pool size binds.
  scheduler, _ = make(num_pages=100, max_model_len=8192, watermark=0.0)
  assert scheduler.add_request(req("fits", 1500, 84)).admitted  # 1,584 tokens = 99 pages
  scheduler.abort("fits")
  answer = scheduler.add_request(req("over", 1500, 85))  # 1,585 tokens = 100 pages
  assert answer.status == 400 and "more than the whole pool (99)" in answer.reason


def test_400_for_an_empty_prompt_and_a_duplicate_id():
  scheduler, _ = make()
  assert scheduler.add_request(req("empty", 0, 5)).status == 400
  assert scheduler.add_request(req("a", 5, 5)).admitted
  duplicate = scheduler.add_request(req("a", 5, 5))
  assert duplicate.status == 400 and "duplicate" in duplicate.reason


# Admission: 503.
def test_503_at_the_watermark_boundary():
  # 99 usable pages, watermark 15% = 14.85 pages must stay free after admission.
  scheduler, _ = make(num_pages=100, watermark=0.15)
  assert scheduler.add_request(req("a", 1300, 44)).admitted  # 84 pages: 15 left >= 14.85
  answer = scheduler.add_request(req("b", 15, 1))  # 1 page more: 14 left < 14.85
  assert answer.status == 503 and "cache pressure" in answer.reason
  assert answer.retry_after is not None and answer.retry_after > 0
  # 85 pages would break the watermark even in an empty cache: 400, not a retryable 503.
  scheduler.abort("a")
  assert scheduler.add_request(req("c", 1300, 45)).status == 400


def test_503_counts_the_admitted_backlog():
  scheduler, _ = make(num_pages=100, watermark=0.15)
  assert scheduler.add_request(req("a", 600, 72)).admitted  # 42 pages, left 57
  assert scheduler.add_request(req("b", 600, 72)).admitted  # 42 more, left 15
  assert scheduler.add_request(req("c", 1, 1)).status == 503  # 1 more, left 14
  assert scheduler.stats()["num_backlog_pages"] == 84


def test_output_estimate_policies_change_the_503_line():
  # max_tokens 1,000 => 63 pages with "max_tokens"; 1 page with fixed=16.
  pessimist, _ = make(num_pages=64, watermark=0.15)
  assert pessimist.add_request(req("a", 8, 1000)).status == 400  # 63 pages: never under it
  optimist, _ = make(num_pages=64, watermark=0.15, output_estimate="fixed",
                     fixed_output_estimate=8)
  assert optimist.add_request(req("a", 8, 1000)).admitted


def test_running_mean_learns_from_finished_outputs():
  scheduler, _ = make(num_pages=64, watermark=0.15, output_estimate="running_mean")
  assert scheduler.add_request(req("long", 8, 1000)).status == 503  # nothing finished yet
  assert scheduler.add_request(req("short", 8, 100, stop_token_ids=(7,))).admitted
  step(scheduler)  # prefill samples 7 = stop after one output token
  assert scheduler.admission.expected_output_tokens(req("x", 8, 1000)) == 1
  assert scheduler.add_request(req("long", 8, 1000)).admitted


# Admission: 429.
def test_429_at_the_waiting_queue_boundary():
  scheduler, _ = make(max_waiting=2)
  assert scheduler.add_request(req("a", 10, 5)).admitted
  assert scheduler.add_request(req("b", 10, 5)).admitted
  answer = scheduler.add_request(req("c", 10, 5))
  assert answer.status == 429 and "waiting queue full (2 of 2)" in answer.reason
  assert answer.retry_after is not None
  out, _ = step(scheduler)  # a and b start running: the queue drains
  assert [(r.request_id, r.status) for r in out.rejected] == [("c", 429)]  # reported once
  assert scheduler.num_waiting == 0 and scheduler.add_request(req("c", 10, 5)).admitted
  assert scheduler.schedule().rejected == []
  assert scheduler.stats()["rejections"] == {400: 0, 429: 1, 503: 0}


# Preemption: victim choice.
def test_victim_is_lowest_priority_then_newest():
  # 3 usable pages of 4 tokens; three 3-token prompts fill them. At the second decode
  # (position 4) every request needs a second page. "top" (priority 0) asks first: the
  # victim is the newest of the two priority-2 requests ("low_new"). "low_old" then asks
  # and is itself the least important request left, so it preempts itself; "top" keeps
  # running.
  scheduler, _ = make(num_pages=4, page_size=4, max_model_len=64, watermark=0.0,
                      output_estimate="fixed", fixed_output_estimate=1)
  for rid, priority in (("top", 0), ("low_old", 2), ("low_new", 2)):
    assert scheduler.add_request(req(rid, 3, 8, priority=priority)).admitted
  out, _ = step(scheduler)
  assert len(out.scheduled) == 3 and scheduler.page_pool.num_free_pages == 0
  out, _ = step(scheduler)
  assert not out.preempted
  out, _ = step(scheduler)
  assert [(p.request_id, p.mode) for p in out.preempted] == [("low_new", "recompute"),
                                                              ("low_old", "recompute")]
  assert [s.request_id for s in out.scheduled] == ["top"]
  assert [r.request_id for r in scheduler.waiting] == ["low_old", "low_new"]  # at the front
  assert scheduler.stats()["preemptions"]["recompute"] == 2


def test_priority_beats_age_in_victim_choice():
  scheduler, _ = make(num_pages=3, page_size=4, max_model_len=64, watermark=0.0,
                      output_estimate="fixed", fixed_output_estimate=1)
  assert scheduler.add_request(req("old_unimportant", 3, 5, priority=5)).admitted
  assert scheduler.add_request(req("new_important", 3, 5, priority=1)).admitted
  step(scheduler)
  step(scheduler)
  out, _ = step(scheduler)
  assert [p.request_id for p in out.preempted] == ["old_unimportant"]
  assert [s.request_id for s in out.scheduled] == ["new_important"]


def test_recompute_prefills_prompt_and_generated_tokens_and_samples_at_the_end():
  scheduler, _ = make(num_pages=3, page_size=4, max_model_len=64, watermark=0.0,
                      output_estimate="fixed", fixed_output_estimate=1, chunk_size=3)
  a = req("a", 3, 5)
  scheduler.add_request(a)
  scheduler.add_request(req("b", 3, 5))
  for _ in range(3):
    step(scheduler)  # b is preempted at the page boundary; a decodes on alone
  b = next(r for r in scheduler.waiting if r.request_id == "b")
  assert b.num_computed_tokens == 0 and b.num_tokens == 5 and "preempted" in b.event_kinds()
  while a.status is RequestStatus.RUNNING:
    step(scheduler)
  out = scheduler.schedule()  # b resumes: 3-token chunk of its 5 tokens, no sample yet
  seq = out.scheduled[0]
  assert (seq.request_id, seq.start_position, seq.token_ids, seq.samples) == (
      "b", 0, [1, 2, 3], False)
  scheduler.update(out, {})
  out, _ = step(scheduler)
  assert (out.scheduled[0].token_ids, out.scheduled[0].samples) == ([7, 7], True)
  assert b.output_ids == [7, 7, 7]


# Preemption: swap.
def test_swap_round_trip_and_resume_before_waiting():
  # 3 usable pages, at most 2 running: "late" waits while a and b run. At position 4
  # a takes the last free page and b, needing one too, is the newest: it swaps out.
  scheduler, _ = make(num_pages=4, page_size=4, max_model_len=64, watermark=0.0,
                      output_estimate="fixed", fixed_output_estimate=1, max_num_seqs=2,
                      preemption_mode="swap", num_host_pages=4)
  for rid in ("a", "b", "late"):
    assert scheduler.add_request(req(rid, 3, 5)).admitted
  b, late = scheduler.requests["b"], scheduler.requests["late"]
  step(scheduler)
  step(scheduler)
  b_pages = list(b.page_ids)
  out, _ = step(scheduler)
  assert [(p.request_id, p.mode) for p in out.preempted] == [("b", "swap")]
  assert out.swap_out == list(zip(b_pages, b.host_page_ids, strict=True))
  assert b.status is RequestStatus.SWAPPED and b.page_ids == [] and b.num_computed_tokens == 4
  assert scheduler.page_pool.num_used_host_pages == 1
  b_host_pages = list(b.host_page_ids)
  while not out.swap_in:  # a decodes to its end; late may not overtake b
    assert late.status is RequestStatus.WAITING
    out, _ = step(scheduler)
  assert [h for h, _ in out.swap_in] == b_host_pages and b.host_page_ids == []
  assert [d for _, d in out.swap_in] == b.page_ids[:1]
  assert [s.request_id for s in out.scheduled] == ["b", "late"]  # b resumes first
  assert out.scheduled[0].start_position == 4 and out.scheduled[0].token_ids == [7]
  assert "swapped_in" in b.event_kinds() and scheduler.page_pool.num_free_host_pages == 4


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full():
  scheduler, _ = make(num_pages=3, page_size=4, max_model_len=64, watermark=0.0,
                      output_estimate="fixed", fixed_output_estimate=1,
                      preemption_mode="swap", num_host_pages=0)
  scheduler.add_request(req("a", 3, 5))
  scheduler.add_request(req("b", 3, 5))
  step(scheduler)
  step(scheduler)
  out, _ = step(scheduler)
  assert [(p.request_id, p.mode) for p in out.preempted] == [("b", "recompute")]
  assert out.swap_out == [] and "swap_fallback" in scheduler.requests["b"].event_kinds()


def test_abort_mode_finishes_the_victim_with_reason_preempted():
  scheduler, _ = make(num_pages=3, page_size=4, max_model_len=64, watermark=0.0,
                      output_estimate="fixed", fixed_output_estimate=1,
                      preemption_mode="abort")
  scheduler.add_request(req("a", 3, 5))
  b = req("b", 3, 5)
  scheduler.add_request(b)
  step(scheduler)
  step(scheduler)
  out, _ = step(scheduler)
  assert [p.mode for p in out.preempted] == ["abort"] and b in out.finished
  assert b.finish_reason == "preempted" and b.page_ids == [] and not scheduler.abort("b")


# Prefill policies: the order inside a step.
def _decoding_plus_long_prompt(policy: str, budget: int):
  scheduler, _ = make(max_model_len=256, prefill_policy=policy, max_num_batched_tokens=budget,
                      chunk_size=0)
  scheduler.add_request(req("short", 4, 10))
  step(scheduler)  # short's prefill; it decodes from now on
  scheduler.add_request(req("long", 200, 10))
  return scheduler


def test_chunked_schedules_decodes_first_and_fills_the_budget_with_a_prefill_chunk():
  scheduler = _decoding_plus_long_prompt("chunked", budget=64)
  out = scheduler.schedule()
  assert [(s.request_id, len(s.token_ids), s.is_prefill) for s in out.scheduled] == [
      ("short", 1, False), ("long", 63, True)]  # Sarathi-Serve: no decode stalls
  assert out.num_batched_tokens == 64 and not out.scheduled[1].samples


def test_no_chunking_prefills_whole_prompts_first_and_decodes_stall():
  scheduler = _decoding_plus_long_prompt("none", budget=256)
  out, _ = step(scheduler)
  assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("long", 200)]
  assert out.scheduled[0].samples  # the whole prompt in one step
  out, _ = step(scheduler)  # no prefill left: both decode
  assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("short", 1),
                                                                       ("long", 1)]


def test_budget_and_max_num_seqs_cap_a_step():
  scheduler, _ = make(max_num_seqs=3, max_num_batched_tokens=50, chunk_size=20)
  for i in range(5):
    scheduler.add_request(req(f"r{i}", 30, 4))
  out = scheduler.schedule()
  assert [len(s.token_ids) for s in out.scheduled] == [20, 20, 10]
  assert scheduler.num_running == 3 and scheduler.num_waiting == 2


# Finishing and aborting.
def test_stop_token_finishes_unless_ignore_eos():
  scheduler, _ = make()
  stopper = req("stopper", 4, 10, stop_token_ids=(7,))
  runner = req("runner", 4, 2, stop_token_ids=(7,), ignore_eos=True)
  scheduler.add_request(stopper)
  scheduler.add_request(runner)
  _, finished = step(scheduler)
  assert finished == [stopper] and stopper.finish_reason == "stop"
  _, finished = step(scheduler)
  assert finished == [runner] and runner.finish_reason == "length"
  assert runner.output_ids == [7, 7] and not scheduler.has_unfinished()
  assert runner.event_kinds() == ["queued", "admitted", "scheduled", "first_token", "finished"]
  assert scheduler.page_pool.num_free_pages == scheduler.page_pool.num_usable_pages


@pytest.mark.parametrize("state", ["waiting", "running", "mid_prefill", "swapped"])
def test_abort_in_any_state_frees_everything(state):
  scheduler, _ = make(num_pages=4, page_size=4, max_model_len=64, watermark=0.0,
                      output_estimate="fixed", fixed_output_estimate=1, max_num_seqs=2,
                      preemption_mode="swap", num_host_pages=4, chunk_size=2)
  a, b = req("a", 3, 5), req("b", 3, 5)
  scheduler.add_request(a)
  scheduler.add_request(b)
  target = {"waiting": b, "running": a, "mid_prefill": a, "swapped": b}[state]
  if state == "mid_prefill":
    step(scheduler)  # 2 of 3 prompt tokens computed
    assert a.num_computed_tokens == 2
  elif state in ("running", "swapped"):
    while b.status is not RequestStatus.SWAPPED:
      step(scheduler)
  assert scheduler.abort(target.request_id)
  assert target.finish_reason == "aborted" and target.page_ids == []
  assert target.event_kinds()[-2:] == ["aborted", "finished"]
  assert target in scheduler.schedule().finished
  assert not scheduler.abort(target.request_id) and not scheduler.abort("never-seen")
  for other in (a, b):
    scheduler.abort(other.request_id)
  bm = scheduler.page_pool
  assert bm.num_free_pages == bm.num_usable_pages and bm.num_free_host_pages == 4
  assert scheduler.stats()["num_backlog_pages"] == 0 and not scheduler.has_unfinished()


def test_abort_between_schedule_and_update_voids_the_step():
  scheduler, _ = make()
  scheduler.add_request(req("a", 4, 3))
  out = scheduler.schedule()
  scheduler.abort("a")
  assert scheduler.update(out, {"a": 7}) == []
  assert scheduler.requests == {} and scheduler.page_pool.num_used_pages == 0


def test_update_rejects_a_missing_sample_and_a_replayed_step():
  scheduler, _ = make()
  scheduler.add_request(req("a", 4, 3))
  out = scheduler.schedule()
  with pytest.raises(ValueError, match="no sampled token for 'a'"):
    scheduler.update(out, {})
  assert scheduler.update(out, {"a": 1}) == []  # the failed update changed nothing
  with pytest.raises(ValueError, match="applied twice"):
    scheduler.update(out, {"a": 1})
  assert scheduler.requests["a"].output_ids == [1]


# Configuration.
@pytest.mark.parametrize("key,value,message", [
    ("prefill_policy", "sarathi", "choose one of: none, chunked"),
    ("preemption_mode", "kill", "choose one of: recompute, swap, abort"),
    ("output_estimate", "median", "choose one of: max_tokens, fixed, running_mean"),
    ("max_num_seqs", 0, "max_num_seqs must be an integer >= 1"),
    ("max_num_batched_tokens", -5, "max_num_batched_tokens must be an integer >= 1"),
    ("max_waiting", -1, "max_waiting must be an integer >= 0"),
    ("chunk_size", -1, "chunk_size must be an integer >= 0"),
    ("watermark", 1.0, "watermark must be a fraction"),
    ("max_retry_after_s", 0.0, "max_retry_after_s must be > 0"),
])
def test_bad_config_values_are_rejected(key, value, message):
  with pytest.raises(ValueError, match=message):
    make(**{key: value})


def test_no_chunking_needs_a_budget_of_a_whole_sequence():
  with pytest.raises(ValueError, match="max_num_batched_tokens >= max_model_len"):
    make(prefill_policy="none", max_num_batched_tokens=2048, max_model_len=4096)


def test_every_config_carries_a_scheduler_section():
  for module in (llama_13b, tiny):
    config = module.get_config()
    assert config.scheduler.watermark == 0.15
    policy.check(config.scheduler, config.model.max_seq_len)
