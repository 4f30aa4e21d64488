"""Admission answers 400 to what can never be served, and never corrupts live requests."""

from configs import scheduler as scheduler_lib
from kvpage.host.scheduler import Scheduler
from kvpage.request import Request, RequestStatus, SamplingParams


def make_scheduler(**overrides) -> Scheduler:
  config = scheduler_lib.get_scheduler_config()
  config.update(overrides)
  return Scheduler(config, num_pages=101, page_size=16, max_model_len=4096, vocab_size=1000)


def test_a_request_that_can_never_clear_the_watermark_is_400_not_503():
  scheduler = make_scheduler()  # 100 usable pages, 15 kept free
  fits = scheduler.add_request(Request("a", [1] * 16, SamplingParams(max_tokens=16 * 84)))
  assert fits.status == 200  # 85 pages leave exactly the watermark
  scheduler.abort("a")
  never = scheduler.add_request(Request("b", [1] * 16, SamplingParams(max_tokens=16 * 85)))
  assert never.status == 400 and "even in an empty cache" in never.reason
  assert never.retry_after is None


def test_out_of_vocabulary_prompt_ids_are_400():
  scheduler = make_scheduler()
  answer = scheduler.add_request(Request("a", [1, 1000, -1], SamplingParams(max_tokens=4)))
  assert answer.status == 400 and "outside the vocabulary [0, 1000)" in answer.reason
  assert scheduler.stats()["rejections"][400] == 1


def test_resubmitting_a_live_request_leaves_it_untouched():
  scheduler = make_scheduler()
  request = Request("a", [1, 2, 3], SamplingParams(max_tokens=4))
  assert scheduler.add_request(request).admitted
  scheduler.schedule()
  events, status = list(request.events), request.status
  answer = scheduler.add_request(request)
  assert answer.status == 400 and "duplicate" in answer.reason
  assert request.status is status is RequestStatus.RUNNING and request.events == events
