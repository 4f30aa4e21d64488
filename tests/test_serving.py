"""The engine holds the KV-cache line under overload, in simulation (13B) and for real (tiny)."""


import ml_collections
import numpy as np
import pytest
import tiny_config

from configs import hardware as hardware_lib
from configs import llama_13b
from kvpage import build, metrics, model_shape, sizing
from kvpage.request import SamplingParams
from kvpage.sim import capacity, replay, workload
from models import llama

A100 = hardware_lib.get_hardware("a100_80gb")
LLAMA_13B = llama_13b.get_config()


def run(engine, trace, *, per_step=None):
  recorder = metrics.MetricsRecorder(engine.scheduler, engine.clock)
  max_waiting = [0]

  def on_step(output, sampled, finished):
    recorder.on_step(output, sampled, finished)
    max_waiting[0] = max(max_waiting[0], engine.scheduler.num_waiting)
    if per_step is not None:
      per_step(engine)

  engine.on_step = on_step
  requests = replay.replay(engine, trace, on_submit=recorder.track, make_sampling=lambda item:
                           SamplingParams(max_tokens=item.output_len, ignore_eos=True))
  return requests, recorder, max_waiting[0]


def sim_13b(scheduler_overrides=None):
  config = llama_13b.get_config()
  config.scheduler.update(scheduler_overrides or {})
  num_pages = sizing.sim_memory_plan(config, A100).num_pages
  return build.sim_engine(config.model, A100, config.scheduler, num_pages=num_pages,
                          page_size=16), config


def assert_line_held(requests, recorder, engine):
  """No admitted request failed, usage stayed <= 100%, and every page came back."""
  admitted = [r for r in requests if r.status.value != "rejected"]
  assert admitted, "nothing was admitted"
  for request in admitted:
    assert request.finish_reason == "length", (request.request_id, request.finish_reason)
    assert request.num_output_tokens == request.sampling.max_tokens
  assert max(step["kv_usage"] for step in recorder.steps) <= 1.0
  blocks = engine.scheduler.page_pool
  assert blocks.num_free_pages == blocks.num_usable_pages


def test_capacity_cross_check_fully_grown_4k_requests():
  """At most as many fully-grown 4k requests as kvpage.sim.capacity says fit, and exactly that many.

  Whole-prompt prefill with a budget that takes every prompt in one step makes the
  admitted requests decode in lockstep, so they all reach 4,096 tokens together.
  """
  engine, config = sim_13b(dict(watermark=0.0, max_num_seqs=64, prefill_policy="none",
                                max_num_batched_tokens=30 * 4096))
  # The pool is the memory plan's: 90% of the device, less weights and activations.
  memory = sizing.sim_memory_plan(config, A100)
  plan = capacity.plan(model_shape.ModelShape.from_config(config.model), seq_len=4096,
                       weight_dtype="fp16", memory_bytes=memory.usable_bytes,
                       reserve_bytes=memory.activation_bytes)
  assert memory.num_pages - 1 == plan.pool_pages - 1  # the null page is one of the pool's
  trace = [workload.TraceRequest(f"r{i}", 0.0, tuple([1] * 4000), 96) for i in range(30)]
  peak = [0]

  def count_full(engine):
    pages = engine.scheduler.page_pool.page_tables()
    peak[0] = max(peak[0], sum(len(p) == plan.pages_per_request for p in pages.values()))

  requests, recorder, _ = run(engine, trace, per_step=count_full)
  # 17 with all 80 GiB and no reserve (the capacity model's figure); a one-step prefill of
  # all 30 prompts (122,880 tokens) reserves 9.9 GiB of activations.
  assert plan.max_concurrent_requests == 12
  assert peak[0] == plan.max_concurrent_requests
  assert_line_held(requests, recorder, engine)


def test_13b_simulation_at_three_times_sustainable_rate_holds_the_line():
  lengths = dict(prompt_len="uniform:256:2048", output_len="uniform:64:512", vocab_size=32000,
                 seed=0)
  # The sustainable rate: what the server completes per second when saturated.
  engine, _ = sim_13b()
  requests, recorder, _ = run(engine, workload.synthesize(num_requests=200,
                                                          arrival_rate=1000.0, **lengths))
  summary = recorder.summary({})
  sustainable = summary["num_finished"] / summary["duration_s"]
  engine, config = sim_13b(dict(max_waiting=32))
  trace = workload.synthesize(num_requests=600, arrival_rate=3 * sustainable, **lengths)
  requests, recorder, max_waiting = run(engine, trace)
  summary = recorder.summary({})
  assert summary["num_rejected"] > 0.2 * len(trace)  # pushed back, not queued
  assert set(summary["rejections"]) <= {"400", "429", "503"} and summary["rejections"]["400"] == 0
  assert max_waiting <= config.scheduler.max_waiting
  assert_line_held(requests, recorder, engine)


def queue_waits(policy: str, rate: float, lengths: dict) -> tuple[list[float], dict]:
  """Queue waits of the admitted requests in arrival order, and the run's summary."""
  engine, _ = sim_13b(dict(admission=policy, max_waiting=0 if policy == "queue_only" else 32))
  requests, recorder, _ = run(engine, workload.synthesize(num_requests=400, arrival_rate=rate,
                                                          **lengths))
  rows = [row for row in recorder.request_rows() if row["queue_wait_s"] is not None]
  assert_line_held(requests, recorder, engine)
  return [row["queue_wait_s"] for row in rows], recorder.summary({})


def test_queue_only_admission_queues_without_bound_past_saturation():
  """vLLM's behaviour: past saturation every request queues, so the wait grows along
  the run while throughput plateaus; the watermark keeps the wait bounded by refusing."""
  lengths = dict(prompt_len="uniform:256:2048", output_len="uniform:64:512", vocab_size=32000,
                 seed=1)
  engine, _ = sim_13b()
  _, recorder, _ = run(engine, workload.synthesize(num_requests=200, arrival_rate=1000.0,
                                                   **lengths))
  saturated = recorder.summary({})
  sustainable = saturated["num_finished"] / saturated["duration_s"]
  waits, summary = queue_waits("queue_only", 3 * sustainable, lengths)
  assert summary["num_rejected"] == 0 and len(waits) == 400  # nothing pushed back
  quarter = len(waits) // 4
  first, last = np.mean(waits[:quarter]), np.mean(waits[-quarter:])
  assert last > 4 * first and last > 10.0  # the queue grows along the run
  throughput = summary["num_finished"] / summary["duration_s"]
  assert throughput == pytest.approx(sustainable, rel=0.25)  # the plateau
  bounded, held = queue_waits("watermark", 3 * sustainable, lengths)
  assert held["num_rejected"] > 0.2 * 400  # refused at the door instead
  assert max(bounded) < last / 2


@pytest.fixture(scope="module")
def tiny_params():
  return llama.random_init(tiny_config.get_config().model, seed=0)


def tiny_engine(tiny_params, num_pages, **overrides):
  config = tiny_config.get_config()
  config.scheduler.update(overrides)
  return build.jax_engine(llama, config.model, tiny_params, config.scheduler, num_pages=num_pages,
                          page_size=16, num_host_pages=config.scheduler.num_host_pages)


def test_real_tiny_model_under_overload_holds_the_line(tiny_params):
  engine = tiny_engine(tiny_params, num_pages=24, max_waiting=4)
  trace = workload.synthesize(num_requests=24, arrival_rate=200.0, prompt_len="uniform:8:40",
                              output_len="uniform:4:24", vocab_size=512, seed=3)
  requests, recorder, max_waiting = run(engine, trace)
  summary = recorder.summary({})
  assert summary["num_rejected"] > 0 and max_waiting <= 4
  assert_line_held(requests, recorder, engine)


def test_real_and_simulated_runs_schedule_identically(tiny_params):
  """Same scheduler code: with all arrivals at t=0, only the executor differs."""
  trace = workload.synthesize(num_requests=10, arrival_rate=float("inf"),
                              prompt_len="uniform:4:40", output_len="uniform:2:12",
                              vocab_size=512, seed=5)
  schedules = []
  for kind in ("jax", "sim"):
    config = tiny_config.get_config()
    config.scheduler.update(dict(chunk_size=16, max_num_batched_tokens=32))
    if kind == "jax":
      engine = tiny_engine(tiny_params, num_pages=20, chunk_size=16, max_num_batched_tokens=32)
    else:
      engine = build.sim_engine(config.model, hardware_lib.get_hardware("cpu"),
                                config.scheduler, num_pages=20, page_size=16)
    steps = []
    engine.on_step = lambda out, sampled, fin, steps=steps: steps.append(
        [(s.request_id, s.start_position, len(s.token_ids)) for s in out.scheduled])
    replay.replay(engine, trace, make_sampling=lambda item: SamplingParams(
        max_tokens=item.output_len, ignore_eos=True))
    # Both schedule asynchronously (the config's default), empty steps included: when
    # every running request's last token is in flight, an empty step is scheduled
    # while that step drains, on the simulated device as on the real one.
    assert engine.async_scheduling
    schedules.append(steps)
  assert schedules[0] == schedules[1] and sum(map(bool, schedules[0])) >= 8


def test_metrics_percentiles_and_goodput():
  assert metrics.percentiles([1.0, 2.0, 3.0, 4.0])["p50"] == 2.5
  assert metrics.percentiles([])["p99"] is None
  engine, _ = sim_13b()
  trace = workload.synthesize(num_requests=20, arrival_rate=4.0, prompt_len="512",
                              output_len="32", vocab_size=32000, seed=1)
  requests, recorder, _ = run(engine, trace)
  rows = {row["request_id"]: row for row in recorder.request_rows()}
  for request in requests:
    row = rows[request.request_id]
    first = next(e.time for e in request.events if e.kind == "first_token")
    assert row["ttft_s"] == pytest.approx(first - request.arrival_time)
    assert len(row["itl_s"]) == 31 and row["tpot_s"] == pytest.approx(np.mean(row["itl_s"]))
  summary = recorder.summary({}, slo_ttft_s=rows["req-0"]["ttft_s"])
  assert 0 < summary["goodput_fraction"] <= 1
  assert summary["output_tokens_per_s"] == pytest.approx(20 * 32 / summary["duration_s"])
  assert isinstance(ml_collections.ConfigDict(summary["ttft_s"]), ml_collections.ConfigDict)


def test_goodput_weighted_by_prompt_tokens_and_split_by_prompt_length():
  assert [metrics.prompt_class(n) for n in (1, 256, 257, 1024, 4096, 4097)] == [
      "<=256", "<=256", "257-1024", "257-1024", "1025-4096", ">4096"]
  assert list(metrics.PROMPT_CLASS_KEYS.values()) == ["upto256", "257to1024", "1025to4096",
                                                      "over4096"]
  engine, _ = sim_13b()
  trace = workload.synthesize(num_requests=40, arrival_rate=8.0, prompt_len="mix:0.25:3000:100",
                              output_len="32", vocab_size=32000, seed=3)
  _, recorder, _ = run(engine, trace)
  rows = recorder.request_rows()
  slo = float(np.median([r["ttft_s"] for r in rows]))  # about half the requests meet it
  summary = recorder.summary({}, slo_ttft_s=slo)
  good = [r for r in rows if r["ttft_s"] is not None and r["ttft_s"] <= slo]
  assert 0 < len(good) < len(rows)
  assert summary["goodput_token_fraction"] == pytest.approx(
      sum(r["prompt_tokens"] for r in good) / sum(r["prompt_tokens"] for r in rows))
  # The long prompts wait longest: weighted by tokens, fewer are within the SLO.
  assert summary["goodput_token_fraction"] < summary["goodput_fraction"]
  classes = summary["by_prompt_length"]
  assert list(classes) == ["<=256", "1025-4096"]  # only the classes the mix draws
  long = [r for r in rows if r["prompt_tokens"] == 3000]
  assert classes["1025-4096"] == dict(
      offered=len(long), finished=len(long), rejected=0,
      good=sum(r in good for r in long), good_fraction=sum(r in good for r in long) / len(long))
  assert sum(c["good"] for c in classes.values()) == len(good)
  refused = dict(request_id="refused", prompt_tokens=8000, status="rejected",
                 finish_reason=None)
  assert metrics.by_prompt_length([*rows, refused], rows, good)[">4096"] == dict(
      offered=1, finished=0, rejected=1, good=0, good_fraction=0.0)


def test_running_batch_weighs_each_step_by_the_time_it_lasted():
  # 2 sequences for 1 s, then 4 for 3 s: 3.5 on average, 4 for three quarters of the time.
  steps = [dict(time=1.0, num_seqs=2, num_running=4), dict(time=4.0, num_seqs=4, num_running=0)]
  assert metrics.running_batch(steps) == dict(mean=3.5, p50=4.0, p99=4.0)
  # Many short steps at 8 and one long one at 1: a mean over steps would say ~7.
  steps = [dict(time=0.01 * (i + 1), num_seqs=8) for i in range(10)] + [
      dict(time=1.1, num_seqs=1)]
  assert metrics.running_batch(steps) == pytest.approx(
      dict(mean=(8 * 0.1 + 1 * 1.0) / 1.1, p50=1.0, p99=8.0))
  # Exactly half the time at each count: p50 is the lower.
  assert metrics.running_batch([dict(time=1.0, num_seqs=3), dict(time=2.0, num_seqs=5)])[
      "p50"] == 3.0
  # Nothing to weigh: None, as `percentiles` has for an empty list.
  assert metrics.running_batch([]) == dict(mean=None, p50=None, p99=None)
  assert metrics.running_batch([dict(time=0.0, num_seqs=3)]) == dict(mean=None, p50=None,
                                                                      p99=None)


def test_running_batch_counts_idle_time_as_an_empty_batch():
  """A step after the server sat idle (the row before left nothing running, waiting or
  swapped) holds its count only for its own seconds; the gap before is a batch of 0."""
  idle = dict(num_running=0, num_waiting=0, num_swapped=0)
  steps = [dict(time=1.0, num_seqs=2, step_s=1.0, **idle),  # from the start: 2 for 1 s
           dict(time=1.0, num_seqs=0, step_s=None, **idle),  # drained
           dict(time=10.0, num_seqs=1, step_s=1.0, num_running=1, num_waiting=0,
                num_swapped=0),  # idle 8 s, then 1 for 1 s
           # Busy before: the whole gap is the step's, whatever its seconds say.
           dict(time=12.0, num_seqs=3, step_s=0.5, **idle)]
  assert metrics.running_batch(steps) == pytest.approx(
      dict(mean=(2 * 1 + 1 * 1 + 3 * 2) / 12, p50=0.0, p99=3.0))


def test_a_simulated_run_reports_its_running_batch():
  """At a light load the mean batch is Little's law's mean number of requests in service
  (the sum of their latencies over the run), far below the batches while busy."""
  engine, _ = sim_13b()
  trace = workload.synthesize(num_requests=30, arrival_rate=0.5, prompt_len="512",
                              output_len="64", vocab_size=32000, seed=1)
  _, recorder, _ = run(engine, trace)
  summary = recorder.summary({})
  batch = summary["running_batch"]
  assert batch == metrics.running_batch(recorder.steps)
  in_service = sum(row["e2e_s"] for row in recorder.request_rows()) / recorder.steps[-1]["time"]
  assert batch["mean"] == pytest.approx(in_service, rel=0.05) and batch["mean"] < 1
  assert batch["p50"] <= batch["p99"] <= max(step["num_seqs"] for step in recorder.steps)
  # Saturated, the batch is large and fills most of the time.
  engine, _ = sim_13b()
  _, recorder, _ = run(engine, workload.synthesize(num_requests=60, arrival_rate=1000.0,
                                                   prompt_len="512", output_len="64",
                                                   vocab_size=32000, seed=1))
  batch = recorder.summary({})["running_batch"]
  assert batch["mean"] > 20 and batch["p50"] > 20


def test_a_simulated_engine_nobody_records_for_keeps_only_a_few_steps_parts():
  """Each step's priced parts wait for a recorder; with none (a bare engine), only the
  last few stay, however long it runs, and the newest is still there to read."""
  from kvpage.sim import executor as sim_executor

  engine, _ = sim_13b()
  replay.replay(engine, workload.synthesize(num_requests=20, arrival_rate=1000.0,
                                            prompt_len="64", output_len="40",
                                            vocab_size=32000, seed=2),
                make_sampling=lambda item: SamplingParams(max_tokens=item.output_len,
                                                          ignore_eos=True))
  executor = engine.executor
  assert len(executor.costs) > sim_executor.KEPT_PARTS  # it ran more steps than it keeps
  assert len(executor._parts) == sim_executor.KEPT_PARTS
  newest = max(executor._parts)
  assert executor.step_parts(newest)["total_s"] > 0 and executor.step_parts(newest) is None
