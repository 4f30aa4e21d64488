"""The gateway's parts without a server: text deltas, stop strings, the wire format,
push-back headers, and the scheduler's wait deadlines."""

import asyncio
import itertools
import math
import threading

import hypothesis
import numpy as np
import pytest
from engine_utils import default_sample, fake_engine
from hypothesis import strategies as st
from serve_utils import make_served_checkpoint

from configs import scheduler as scheduler_lib
from kvpage.clock import PacedClock
from kvpage.host.scheduler import Scheduler
from kvpage.request import Request, RequestStatus, SamplingParams
from kvpage.serve import protocol
from kvpage.serve.app import MAX_RETRY_AFTER_S, push_back_headers
from kvpage.serve.detokenize import IncrementalDetokenizer, StopStrings
from kvpage.serve.engine_loop import Delta, EngineLoop, EngineStoppedError, Stream, Submission
from kvpage.serve.metrics import ServerMetrics

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  directory = make_served_checkpoint(tmp_path_factory.mktemp("served"))
  return transformers.AutoTokenizer.from_pretrained(str(directory))


def _stream(tokenizer, prompt: list[int], output: list[int], sizes: list[int]) -> list[str]:
  detokenizer = IncrementalDetokenizer(tokenizer, prompt)
  deltas, start = [], 0
  for size in itertools.cycle(sizes):
    if start >= len(output):
      break
    deltas.append(detokenizer.push(output[start:start + size]))
    start += size
  deltas.append(detokenizer.flush())
  return deltas


def test_deltas_concatenate_to_the_whole_decoding_and_never_split_a_character(tokenizer):
  text = "naïve café 日本語 🙂 and the quick brown fox"
  output = tokenizer.encode(text)
  assert len(output) > len(text.split())  # some characters span several tokens
  for sizes in ([1], [2, 1], [3]):
    deltas = _stream(tokenizer, tokenizer.encode("Hello"), output, sizes)
    assert "".join(deltas) == tokenizer.decode(output) == text
    assert not any("\ufffd" in delta for delta in deltas)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(st.data())
def test_random_token_streams_decode_as_a_whole(tokenizer, data):
  """Whatever a model emits — invalid UTF-8 included — the deltas join to decode()."""
  vocab = len(tokenizer)
  output = data.draw(st.lists(st.integers(3, vocab - 1), min_size=1, max_size=24))
  sizes = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
  deltas = _stream(tokenizer, [5, 6], output, sizes)
  assert "".join(deltas) == tokenizer.decode(output, skip_special_tokens=True)


def test_stop_strings_match_across_pushes_and_hold_back_a_partial_match():
  stops = StopStrings(["END", "\n\n"])
  assert stops.push("hello E") == "hello "  # "E" may begin "END"
  assert stops.push("N") == ""
  assert stops.push("Dgame over") == ""  # matched: the stop string is not emitted
  assert stops.stopped and stops.push("more") == "" and stops.flush() == ""
  other = StopStrings(["END"])
  assert other.push("the E") == "the " and other.push("nd") == "End"
  assert other.push("E") == "" and other.flush() == "E"  # never completed
  first = StopStrings(["b", "abc"])
  assert first.push("xabc") == "x"  # the earliest match wins ("abc" at 1, not "b" at 2)
  assert StopStrings([]).push("anything") == "anything"
  assert first.matched == "abc" and stops.matched == "END"
  kept = StopStrings(["END"], include=True)  # include_stop_str_in_output
  assert kept.push("the E") == "the " and kept.push("ND and more") == "END"
  # min_tokens: text pushed while not armed is passed through unsearched.
  early = StopStrings(["END"])
  assert early.push("END", armed=False) == "END" and not early.stopped
  assert early.push("x E", armed=True) == "x " and early.push("ND") == ""
  assert early.stopped


def test_special_tokens_show_in_the_text_only_when_asked(tokenizer):
  from serve_utils import EOS

  output = [*tokenizer.encode("Hello"), tokenizer.convert_tokens_to_ids(EOS),
            *tokenizer.encode(" there")]
  for skip in (True, False):
    detokenizer = IncrementalDetokenizer(tokenizer, [5], skip_special_tokens=skip)
    text = detokenizer.push(output) + detokenizer.flush()
    assert text == ("Hello there" if skip else f"Hello{EOS} there")


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"prompt": [1], "n": 0}, "n", "invalid_value"),
    ({"prompt": [1], "echo": 1}, "echo", "invalid_value"),
    ({"prompt": [1], "best_of": 3}, "best_of", "unsupported_option"),
    ({"prompt": [1], "logprobs": 21}, "logprobs", "invalid_value"),
    ({"prompt": [1], "logprobs": True}, "logprobs", "invalid_value"),
    ({"prompt": [1], "presence_penalty": 0.5}, "presence_penalty", "unsupported_option"),
    ({"prompt": [1], "bogus": 1}, "bogus", "unknown_field"),
    ({"prompt": [1], "max_tokens": -1}, "max_tokens", "invalid_value"),
    ({"prompt": [1], "max_tokens": "8"}, "max_tokens", "invalid_value"),
    ({"prompt": [1], "max_tokens": True}, "max_tokens", "invalid_value"),
    ({"prompt": [1], "temperature": -0.1}, "temperature", "invalid_value"),
    ({"prompt": [1], "top_p": 0}, "top_p", "invalid_value"),
    ({"prompt": [1], "seed": -1}, "seed", "invalid_value"),
    ({"prompt": [1], "stop": [""]}, "stop", "invalid_value"),
    ({"prompt": [1], "stream_options": {"include_usage": True}}, "stream_options",
     "invalid_value"),
    ({"prompt": [1], "max_queue_wait_s": 0}, "max_queue_wait_s", "invalid_value"),
    ({"prompt": ""}, "prompt", "empty_prompt"),
    ({"prompt": [1.5]}, "prompt", "invalid_prompt"),
    ({"prompt": [[1], [2]]}, "prompt", "unsupported_option"),
    ({"prompt": None}, "prompt", "invalid_prompt"),
])
def test_completion_bodies_are_refused_by_field(body, param, code):
  with pytest.raises(protocol.ApiError) as caught:
    protocol.parse_completion(body)
  error = caught.value
  assert (error.status, error.param, error.code) == (400, param, code)
  assert param in error.message and error.body()["error"]["type"] == "invalid_request_error"


def test_no_op_defaults_and_kvpage_fields_are_accepted():
  parsed = protocol.parse_completion({
      "prompt": [[1, 2]], "n": 1, "logprobs": None, "echo": False, "presence_penalty": 0,
      "user": "u", "top_k": -1, "seed": 7, "stop": "x", "ignore_eos": True, "priority": -3,
      "stream": True, "stream_options": {"include_usage": True, "include_status": True},
      "max_queue_wait_s": 2.5})
  assert parsed.prompt_ids == [1, 2] and parsed.top_k == 0 and parsed.stop == ("x",)
  assert parsed.include_status and parsed.include_usage and parsed.max_queue_wait_s == 2.5
  assert parsed.temperature == 1.0  # OpenAI's default
  with pytest.raises(protocol.ApiError, match="'n'"):
    protocol.parse_completion({"prompt": [1], "n": True})  # True is not 1


def test_chat_bodies():
  parsed = protocol.parse_chat({"messages": [
      {"role": "system", "content": "be brief"},
      {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text",
                                                                      "text": "there"}]}],
      "max_completion_tokens": 5})
  assert parsed.messages[1] == {"role": "user", "content": "hi there"} and parsed.max_tokens == 5
  for body, param in (({"messages": []}, "messages"),
                      ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
                      ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                       "messages[0].content"),
                      ({"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, "tools")):
    with pytest.raises(protocol.ApiError) as caught:
      protocol.parse_chat(body)
    assert caught.value.param == param


def test_push_back_headers_cap_at_two_minutes_and_say_not_to_retry_beyond():
  headers = push_back_headers(2.3456, "kv_pressure")
  assert headers == {"x-kvpage-reject-reason": "kv_pressure", "retry-after-ms": "2346",
                     "Retry-After": "3", "x-should-retry": "true"}
  tiny = push_back_headers(0.0001, "queue_full")
  assert tiny["retry-after-ms"] == "1" and tiny["Retry-After"] == "1"  # at least one second
  long = push_back_headers(MAX_RETRY_AFTER_S * 3, "kv_pressure")
  assert long["retry-after-ms"] == "120000" and long["Retry-After"] == "120"
  assert long["x-should-retry"] == "false"
  assert push_back_headers(None, "draining") == {"x-kvpage-reject-reason": "draining"}


class _Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self) -> float:
    return self.now


def _scheduler(clock, **overrides) -> Scheduler:
  config = scheduler_lib.get_scheduler_config()
  config.update(dict(max_num_seqs=1, max_num_batched_tokens=64, watermark=0.0,
                     async_scheduling=False, **overrides))
  return Scheduler(config, num_pages=64, page_size=4, max_model_len=128, clock=clock)


def _run_step(scheduler: Scheduler, clock: _Clock, seconds: float) -> None:
  output = scheduler.schedule()
  clock.now += seconds
  scheduler.update(output, {seq.request_id: 1 for seq in output.scheduled if seq.samples})


def test_a_request_forecast_to_wait_past_its_deadline_is_refused_at_the_door():
  clock = _Clock()
  scheduler = _scheduler(clock)
  first = Request("first", [1] * 8, SamplingParams(max_tokens=50))
  assert scheduler.add_request(first).admitted
  for _ in range(4):  # price some steps: prefill, then decodes of 0.1 s
    _run_step(scheduler, clock, 0.1)
  stats = scheduler.stats()
  patient = Request("patient", [1] * 8, SamplingParams(max_tokens=4), max_queue_wait_s=100.0)
  assert scheduler.add_request(patient).admitted  # waits ~4.6 s behind `first`
  hurried = Request("hurried", [1] * 8, SamplingParams(max_tokens=4), max_queue_wait_s=1.0)
  answer = scheduler.add_request(hurried)
  assert (answer.status, answer.cause) == (429, "wait_deadline")
  assert "exceeds the request's max_queue_wait_s 1" in answer.reason
  assert answer.retry_after is not None and answer.retry_after > 3.0  # ~5 s, less its 1 s
  # Taken back out whole: nothing of it stays in the queue, the backlog or the counts.
  assert hurried.status is RequestStatus.REJECTED and "hurried" not in scheduler.requests
  assert [r.request_id for r in scheduler.waiting] == ["patient"]
  after = scheduler.stats()
  assert after["num_admitted"] == stats["num_admitted"] + 1
  assert after["rejections"][429] == 1
  assert scheduler.admission.num_backlog_pages == scheduler.admission.estimate_pages(patient)


def test_metrics_report_how_long_an_audited_refusal_really_had_to_wait():
  clock = _Clock()
  scheduler = _scheduler(clock, retry_audit=4)
  metrics = ServerMetrics(scheduler, clock, "fake")
  assert scheduler.add_request(Request("first", [1] * 8, SamplingParams(max_tokens=12))).admitted
  for _ in range(4):
    _run_step(scheduler, clock, 0.1)
  hurried = Request("hurried", [1] * 8, SamplingParams(max_tokens=4), max_queue_wait_s=0.5)
  answer = scheduler.add_request(hurried)
  assert answer.cause == "wait_deadline"
  refused_at = clock.now
  while scheduler.audit.num_open:  # `first` has 8 decodes left: a retry fits once it nears its end
    output = scheduler.schedule()
    clock.now += 0.1
    scheduler.update(output, {seq.request_id: 1 for seq in output.scheduled if seq.samples})
    metrics.on_step(output, {}, [])
  needed = clock.now - refused_at
  assert 0.1 <= needed <= answer.retry_after + 0.1 + 1e-9
  text = metrics.render().decode()
  assert ('kvpage:retry_hint_ratio_count{model_name="fake",reason="wait_deadline"} 1.0'
          in text)
  assert (f'kvpage:retry_needed_seconds_sum{{model_name="fake",reason="wait_deadline"}} '
          f'{needed!r}' in text)


def test_a_deadline_that_passes_in_the_queue_ends_the_request_and_frees_its_place():
  clock = _Clock()
  scheduler = _scheduler(clock)
  assert scheduler.add_request(Request("long", [1] * 8, SamplingParams(max_tokens=30))).admitted
  _run_step(scheduler, clock, 0.1)  # `long` holds the one running slot
  late = Request("late", [1] * 8, SamplingParams(max_tokens=4), max_queue_wait_s=0.5)
  # No decode priced yet: the forecast cannot say, so the deadline is checked while it waits.
  answer = scheduler.add_request(late)
  if not answer.admitted:
    pytest.skip("the forecast already refuses it at the door")  # tested above
  clock.now += 0.6
  output = scheduler.schedule()
  assert late in output.finished and late.finish_reason == "deadline"
  assert "late" not in scheduler.requests and not scheduler.waiting
  assert scheduler.admission.num_backlog_pages == 0
  assert math.isclose(scheduler.page_pool.num_used_pages,
                      len(scheduler.requests["long"].page_ids))
  # Its 429 carries a hint (`Scheduler.deadline_retry_after`): still unpriced, the default.
  hint = scheduler.deadline_retry_after(late)
  assert hint == scheduler.admission.wait.default_s > 0


def test_a_scheduled_request_outlives_its_deadline():
  clock = _Clock()
  scheduler = _scheduler(clock)
  request = Request("r", [1] * 8, SamplingParams(max_tokens=10), max_queue_wait_s=0.5)
  assert scheduler.add_request(request).admitted
  for _ in range(6):
    _run_step(scheduler, clock, 0.2)
  assert request.status is RequestStatus.RUNNING and len(request.output_ids) == 6


def test_abort_with_a_reason_finishes_with_that_reason():
  clock = _Clock()
  scheduler = _scheduler(clock, output_estimate="running_mean")
  request = Request("r", [1] * 8, SamplingParams(max_tokens=10))
  scheduler.add_request(request)
  _run_step(scheduler, clock, 0.1)
  assert scheduler.abort("r", "stop") and request.finish_reason == "stop"
  assert scheduler.page_pool.num_used_pages == 0
  assert list(scheduler.admission._recent_outputs) == [1]  # a stop counts as an output


def test_bad_deadlines_are_refused_when_the_request_is_made():
  for value in (0.0, -1.0, math.nan, math.inf):
    with pytest.raises(ValueError, match="max_queue_wait_s"):
      Request("r", [1], SamplingParams(max_tokens=1), max_queue_wait_s=value)
  assert np.isfinite(Request("r", [1], SamplingParams(max_tokens=1),
                             max_queue_wait_s=1.0).max_queue_wait_s)


def test_a_paced_clock_sleeps_through_what_a_simulated_step_costs():
  clock = PacedClock()
  start = clock()
  clock.advance(0.05)
  assert clock() - start >= 0.05
  clock.advance_to(start + 0.08)
  assert clock() - start >= 0.08
  with pytest.raises(ValueError, match="backwards"):
    clock.advance(-1.0)


def _engine_loop_run(engine, coroutine_fn):
  async def main():
    metrics = ServerMetrics(engine.scheduler, engine.clock, "fake")
    loop = EngineLoop(engine, asyncio.get_running_loop(), metrics=metrics)
    loop.start()
    try:
      return await asyncio.wait_for(coroutine_fn(loop), 30)
    finally:
      loop.stop()

  return asyncio.run(main())


def test_the_engine_thread_streams_deltas_and_ends_with_usage():
  engine = fake_engine()

  async def run(loop):
    answer, stream = await loop.submit(Submission("a", [1, 2, 3], SamplingParams(max_tokens=5)))
    assert answer.admitted
    last = await stream.done
    tokens = []
    for delta in stream.delivered():
      tokens += delta.token_ids
    return last, tokens

  last, tokens = _engine_loop_run(engine, run)
  assert last.finish_reason == "length" and last.num_output_tokens == 5 and len(tokens) == 5
  assert engine.scheduler.page_pool.num_used_pages == 0


def test_a_request_arrives_when_the_http_layer_stamps_it_not_when_the_engine_sees_it():
  engine = fake_engine()
  stamped = engine.clock() - 0.25  # e.g. a step in progress, then tokenizing

  made = []
  add_request = engine.add_request

  def recording_add(*args, **kwargs):
    request, answer = add_request(*args, **kwargs)
    made.append(request)
    return request, answer

  engine.add_request = recording_add

  async def run(loop):
    answer, stream = await loop.submit(Submission(
        "a", [1, 2, 3], SamplingParams(max_tokens=2), arrival_time=stamped))
    assert answer.admitted
    await stream.done

  _engine_loop_run(engine, run)
  assert [request.arrival_time for request in made] == [stamped]


def test_a_failing_engine_ends_every_stream_and_refuses_new_work():
  engine = fake_engine()

  def broken_step():
    raise RuntimeError("device lost")

  async def run(loop):
    engine.step = broken_step  # the first step after the admission raises, on the thread
    answer, stream = await loop.submit(Submission("a", [1, 2, 3], SamplingParams(max_tokens=50)))
    assert answer.admitted
    last = await stream.done
    with pytest.raises(EngineStoppedError, match="device lost"):
      await loop.submit(Submission("b", [1], SamplingParams(max_tokens=1)))
    loop.abort("a")  # a no-op now, not an error
    return last, loop

  last, loop = _engine_loop_run(engine, run)
  assert last.finish_reason == "error" and not loop.alive


def test_an_id_reused_at_once_is_not_ended_by_the_report_of_the_request_before():
  aborted = threading.Event()

  def sample(request_id: str, position: int) -> int:
    # The first request cannot run to its length before the client's abort is queued,
    # however the threads are scheduled: its 10th position waits for the abort.
    if position == 10:
      aborted.wait(timeout=10)
    return default_sample(request_id, position)

  engine = fake_engine(sample=sample)

  async def run(loop):
    _, first = await loop.submit(Submission("same", [1, 2, 3], SamplingParams(max_tokens=200)))
    loop.abort("same")  # the client went away; the engine reports the end a step later
    aborted.set()
    answer, second = await loop.submit(Submission("same", [4, 5], SamplingParams(max_tokens=6)))
    assert answer.admitted
    return await first.done, await second.done

  first, second = _engine_loop_run(engine, run)
  assert first.finish_reason == "abort"
  assert second.finish_reason == "length" and second.num_output_tokens == 6


def test_a_stream_hands_over_deltas_in_order_and_times_out_with_none():
  async def run():
    loop = asyncio.get_running_loop()
    stream = Stream("a", [1, 2, 3], loop)
    assert await stream.next(timeout_s=0.01) is None  # nothing came: the status tick
    stream.deliver(Delta("x", (1,)))
    stream.deliver(Delta("y", (2,)))
    first, second = await stream.next(0.01), await stream.next(0.01)
    waiting = asyncio.ensure_future(stream.next(timeout_s=5.0))
    await asyncio.sleep(0)
    loop.call_soon(stream.deliver, Delta("z", (3,), "length", num_output_tokens=3))
    third = await asyncio.wait_for(waiting, 1.0)  # woken by the delivery, not the timer
    return first, second, third, stream

  first, second, third, stream = asyncio.run(run())
  assert [d.text for d in (first, second, third)] == ["x", "y", "z"]
  assert stream.done.result() is third and stream.delivered() == []


# vLLM's metrics (its v1 engine's Prometheus names and labels): what a dashboard built
# for vLLM queries. Each with `model_name` and `engine`; request_success_total with
# `finished_reason` too.
VLLM_SERIES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge", "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter", "vllm:num_preemptions": "counter",
    "vllm:request_success": "counter", "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter", "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram"}


def _families(metrics: ServerMetrics) -> dict:
  from prometheus_client.parser import text_string_to_metric_families

  return {family.name: family
          for family in text_string_to_metric_families(metrics.render().decode())}


def test_vllms_series_and_every_label_set_are_exported_at_zero_before_any_request():
  engine = fake_engine()
  families = _families(ServerMetrics(engine.scheduler, engine.clock, "m"))
  for name, kind in VLLM_SERIES.items():
    family = families[name]
    assert family.type == kind, name
    samples = [s for s in family.samples if not s.name.endswith(("_bucket", "_sum"))]
    assert samples and all(s.value == 0 for s in samples), name
    for sample in samples:
      expected = {"model_name", "engine"} | ({"finished_reason"}
                                             if name == "vllm:request_success" else set())
      assert set(sample.labels) == expected and sample.labels["engine"] == "0", sample
  reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
  assert reasons == {"stop", "length", "abort"}
  # kvpage's own, at zero too, for each label value they can take.
  modes = {s.labels["mode"] for s in families["kvpage:num_preemptions"].samples}
  assert modes == {"recompute", "swap", "abort"}
  codes = {s.labels["code"] for s in families["kvpage:request_rejections"].samples}
  assert {"400", "429", "503"} <= codes
  assert families["kvpage:time_to_first_token_seconds"].samples


def test_the_vllm_twins_follow_kvpages_series():
  engine = fake_engine()

  async def run(loop):
    for name in ("a", "b"):
      _, stream = await loop.submit(Submission(name, [1, 2, 3],
                                                    SamplingParams(max_tokens=4)))
      await stream.done
    return loop.metrics

  metrics = _engine_loop_run(engine, run)
  families = _families(metrics)

  def value(name: str, suffix: str = "", **labels: str) -> float:
    return sum(s.value for s in families[name].samples if s.name == name + suffix
               and all(s.labels.get(k) == v for k, v in labels.items()))

  assert value("vllm:generation_tokens", "_total") == value(
      "kvpage:generation_tokens", "_total") == 8
  assert value("vllm:request_success", "_total", finished_reason="length") == value(
      "kvpage:request_success", "_total", finish_reason="length") == 2
  assert value("vllm:time_to_first_token_seconds", "_count") == 2
