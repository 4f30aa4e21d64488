"""Async scheduling: step N+1 is launched before step N's samples reach the host.

The tokens must be exactly those of the synchronous loop; what changes is only when
the host learns them. These tests pin the cases where the lag could leak: stop
tokens found a step late, aborts of a request whose step is in flight, the stream of
`step()` outputs, and the batch encoding of a token that is still on the device.
"""

import pytest
import tiny_config
from engine_utils import run_streaming

from kvpage import batch as batch_lib
from kvpage import build
from kvpage.interface import ScheduledSequence
from kvpage.request import PLACEHOLDER, Request, SamplingParams
from models import llama

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9], [2, 7, 1, 8]]


@pytest.fixture(scope="module")
def params():
  return llama.random_init(tiny_config.get_config().model, seed=0)


def engine_for(params, async_scheduling: bool, num_pages: int = 64):
  config = tiny_config.get_config()
  config.scheduler.update(dict(async_scheduling=async_scheduling, watermark=0.0))
  return build.jax_engine(llama, config.model, params, config.scheduler, num_pages=num_pages,
                          page_size=16)


def test_stop_tokens_found_a_step_late_give_the_synchronous_tokens(params):
  greedy = SamplingParams(max_tokens=12, ignore_eos=True)
  reference = engine_for(params, False).generate(PROMPTS, greedy)
  stop = reference[0].output_ids[4]  # request 0 stops at its 5th token (or earlier)
  sampling = SamplingParams(max_tokens=12, stop_token_ids=(stop,))
  sync = engine_for(params, False).generate(PROMPTS, sampling)
  engine = engine_for(params, True)
  requests, outputs = run_streaming(engine, PROMPTS, sampling)
  assert [r.output_ids for r in requests] == [r.output_ids for r in sync]
  assert [r.finish_reason for r in requests] == [r.finish_reason for r in sync]
  assert requests[0].finish_reason == "stop" and requests[0].output_ids[-1] == stop
  assert all(r.num_pending == 0 for r in requests)
  # The stream: each request's tokens arrive once, in order, then one finished output.
  for request in requests:
    mine = [o for o in outputs if o.request_id == request.request_id]
    assert [t for o in mine for t in o.new_token_ids] == request.output_ids
    assert [o.finished for o in mine] == [False] * (len(mine) - 1) + [True]
  bm = engine.scheduler.page_pool
  assert bm.num_free_pages == bm.num_usable_pages


def test_abort_of_a_request_in_flight_drops_its_late_token(params):
  engine = engine_for(params, True)
  sampling = SamplingParams(max_tokens=20, ignore_eos=True)
  requests = [engine.add_request(p, sampling)[0] for p in PROMPTS]
  outputs = []
  for _ in range(5):
    outputs.extend(engine.step())
  victim = requests[1]
  assert engine._in_flight is not None and victim.num_pending == 1
  assert engine.abort(victim.request_id)
  kept = list(victim.output_ids)
  while engine.has_unfinished():
    outputs.extend(engine.step())
  assert victim.output_ids == kept and victim.finish_reason == "aborted"
  mine = [o for o in outputs if o.request_id == victim.request_id]
  assert [t for o in mine for t in o.new_token_ids] == kept
  assert [o.finished for o in mine].count(True) == 1 and mine[-1].finish_reason == "aborted"
  assert [len(r.output_ids) for r in (requests[0], requests[2])] == [20, 20]
  bm = engine.scheduler.page_pool
  assert bm.num_free_pages == bm.num_usable_pages


def test_async_and_sync_generate_the_same_tokens_when_sampling(params):
  sampling = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7,
                            ignore_eos=True)
  outputs = [[r.output_ids for r in engine_for(params, mode).generate(PROMPTS, sampling)]
             for mode in (False, True)]
  assert outputs[0] == outputs[1]


def sequence(request_id: str, token_ids: list[int], start: int) -> ScheduledSequence:
  request = Request(request_id, [1] * start, SamplingParams(max_tokens=4))
  return ScheduledSequence(request_id, token_ids, start, [5], True, False, request)


def test_a_token_in_flight_is_encoded_as_its_row_in_the_previous_step():
  scheduled = [sequence("a", [11], 3), sequence("b", [PLACEHOLDER], 6)]
  batch, _ = batch_lib.build(scheduled, page_size=16, feed_rows={"b": 5, "c": 0})
  assert batch.token_ids[:2].tolist() == [11, -6]
  with pytest.raises(ValueError, match="request b: a token in flight"):
    batch_lib.build(scheduled, page_size=16, feed_rows={"a": 0})
