"""Request ids over a request's whole life: a duplicate of a live id ends rejected, and an
id reused after an abort reports both requests' ends, each once."""

import pytest
from engine_utils import fake_engine

from configs import scheduler as scheduler_lib
from kvpage.host.scheduler import Scheduler
from kvpage.request import Request, RequestStatus, SamplingParams


def test_a_duplicate_of_a_live_id_ends_rejected_and_leaves_the_live_one_alone():
  config = scheduler_lib.get_scheduler_config()
  scheduler = Scheduler(config, num_pages=33, page_size=4, max_model_len=64,
                        clock=lambda: 2.0)
  live = Request("a", [1, 2, 3], SamplingParams(max_tokens=4))
  assert scheduler.add_request(live).admitted
  events = list(live.events)
  twin = Request("a", [4, 5], SamplingParams(max_tokens=2))
  answer = scheduler.add_request(twin)
  assert answer.status == 400 and "duplicate request_id 'a'" in answer.reason
  assert twin.status is RequestStatus.REJECTED and twin.is_finished
  assert twin.event_kinds() == ["queued", "rejected"]
  assert twin.events[-1].detail["reason"] == answer.reason and twin.arrival_time == 2.0
  assert live.events == events and live.status is RequestStatus.WAITING
  assert scheduler.requests["a"] is live
  assert [a.request_id for a in scheduler.schedule().rejected] == ["a"]  # reported once
  assert scheduler.schedule().rejected == []


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_id_reused_after_an_abort_reports_both_ends(async_scheduling):
  engine = fake_engine(async_scheduling=async_scheduling)
  old, answer = engine.add_request([1, 2, 3], SamplingParams(max_tokens=8), request_id="a")
  assert answer.admitted
  outputs = engine.step() + engine.step()  # running, with a token or two streamed
  assert engine.abort("a")
  new, answer = engine.add_request([7, 8], SamplingParams(max_tokens=3), request_id="a")
  assert answer.admitted and new is not old
  while engine.has_unfinished():
    outputs += engine.step()
  assert all(o.request_id == "a" for o in outputs)
  ends = [o for o in outputs if o.finished]
  assert [(o.finish_reason, o.status) for o in ends] == [("aborted", "finished"),
                                                         ("length", "finished")]
  # The old request's end comes before any token of the new one.
  cut = outputs.index(ends[0]) + 1
  assert [t for o in outputs[:cut] for t in o.new_token_ids] == old.output_ids
  assert [t for o in outputs[cut:] for t in o.new_token_ids] == new.output_ids
  assert len(new.output_ids) == 3 and old.finish_reason == "aborted"


@pytest.mark.parametrize("bad", [dict(temperature=float("nan")), dict(temperature=float("inf")),
                                 dict(top_p=float("nan")), dict(top_k=2**31),
                                 dict(temperature=-1.0)])
def test_sampling_params_refuse_values_the_device_cannot_take(bad):
  with pytest.raises(ValueError, match="need finite temperature"):
    SamplingParams(max_tokens=4, **bad)
