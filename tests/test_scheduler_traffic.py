"""Random traffic against tiny pools: the scheduler's invariants hold after every step.

Hypothesis draws the knobs (both prefill policies, all three preemption modes, pools
of a few pages that force pressure, small host pools, synchronous or async
scheduling, one or several decode iterations per launch) and a traffic plan
(arrivals with random lengths and priorities, stop tokens, aborts), and runs it
through an `Engine` over the tests' fake executor (`engine_utils.FakeExecutor`). The
fake plays the device: it writes (request, position, token) into the KV slot of
every computed token, performs the swap copies, and before each step checks that
every earlier position of the sequence still reads back what was written, and that
every token it is fed, placeholders of async scheduling included, is the model's.
That catches any page handed to two requests, any swap that lost a page, any
recompute that skipped a token and any token lost or fed twice — the cache content
itself is the oracle.
"""

import dataclasses
import random
import zlib

import pytest
from engine_utils import FakeExecutor, expected_token
from hypothesis import event, given, settings
from hypothesis import strategies as st

from configs import scheduler as scheduler_config
from kvpage.host import scheduler_config as policy
from kvpage.host.engine import Engine, RequestOutput
from kvpage.host.request import Request, RequestStatus, SamplingParams
from kvpage.host.scheduler import Scheduler, SchedulerOutput
from kvpage.units import NULL_PAGE

MAX_MODEL_LEN = 64
STOP_TOKEN = 0


def check_pages(scheduler: Scheduler) -> None:
  """free + owned = total, no page owned twice, ref counts >= 0, tables match requests."""
  bm = scheduler.page_pool
  for tables, free, refs, total in (
      (bm.page_tables(), bm.free_page_ids(), bm.ref_counts(), range(1, bm.num_pages)),
      (bm.host_page_tables(), bm.free_host_page_ids(), bm.host_ref_counts(),
       range(bm.num_host_pages))):
    owned = [page for pages in tables.values() for page in pages]
    assert len(owned) == len(set(owned)), "a page is owned by two requests"
    assert sorted(owned + free) == list(total), "free + owned != total"
    assert (refs >= 0).all() and refs[owned].tolist() == [1] * len(owned)
  assert bm.ref_counts()[NULL_PAGE] == 0 and 0 <= bm.usage <= 1
  live = {rid: r for rid, r in scheduler.requests.items()}
  assert set(bm.page_tables()) <= {rid for rid, r in live.items()
                                   if r.status is RequestStatus.RUNNING}
  assert set(bm.host_page_tables()) <= {rid for rid, r in live.items()
                                        if r.status is RequestStatus.SWAPPED}
  for request in scheduler.running:
    assert request.page_ids == bm.page_table(request.request_id)
    assert len(request.page_ids) * bm.page_size >= request.num_computed_tokens
  for request in scheduler.waiting:
    assert request.page_ids == [] and request.status is RequestStatus.WAITING
  assert scheduler.num_running <= scheduler.config.max_num_seqs


def check_step(scheduler: Scheduler, out: SchedulerOutput,
               in_flight: SchedulerOutput | None) -> None:
  """A freshly scheduled step, before it runs; `in_flight` is the step launched before
  it and not collected yet (async scheduling)."""
  config = scheduler.config
  assert out.num_batched_tokens == sum(len(s.token_ids) for s in out.scheduled)
  assert out.num_batched_tokens <= config.max_num_batched_tokens
  assert len(out.scheduled) <= config.max_num_seqs
  assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
  pending_before = {} if in_flight is None else {
      s.request_id: s.samples * s.num_steps for s in in_flight.scheduled}
  for seq in out.scheduled:
    request = seq.request
    # The last position the step computes: a multi-step decode adds an iteration each.
    last = seq.start_position + len(seq.token_ids) + seq.num_steps - 1
    assert request.num_computed_tokens == last  # committed when scheduled
    assert len(seq.page_ids) * scheduler.page_pool.page_size >= last
    # A sampling step's tokens are pending until update(): counted in num_tokens.
    assert (last == request.num_tokens - 1) if seq.samples else (last < request.num_tokens)
    assert request.num_pending == (seq.samples * seq.num_steps
                                   + pending_before.get(seq.request_id, 0))
    assert request.num_sampled <= request.sampling.max_tokens  # no token past the end
    if config.prefill_policy == "none" and seq.is_prefill:
      assert seq.start_position == 0 and seq.samples  # whole prompts only
    if config.prefill_policy == "chunked" and config.chunk_size:
      assert len(seq.token_ids) <= config.chunk_size
    if seq.num_steps > 1:  # multi-step: decodes only, within the launch's iterations
      assert not seq.is_prefill and seq.num_steps <= out.num_steps
  assert out.num_steps <= config.num_decode_steps


@dataclasses.dataclass
class Arrival:
  num_prompt: int
  max_tokens: int
  priority: int
  stops: bool


arrivals = st.builds(Arrival, st.integers(1, 40), st.integers(1, 24), st.integers(0, 3),
                     st.booleans())
plans = st.lists(st.tuples(st.lists(arrivals, max_size=3), st.lists(st.integers(0, 99),
                                                                    max_size=1)),
                 min_size=1, max_size=25)


def make_scheduler(draw, policy: str, mode: str, loop: tuple[bool, int] | None = None
                   ) -> Scheduler:
  """Knobs biased towards pressure: small pools, optimistic output estimates. `loop`:
  (async scheduling, decode iterations per launch), drawn when None."""
  async_scheduling, num_decode_steps = loop or (draw(st.booleans()),
                                                draw(st.sampled_from([1, 4])))
  config = scheduler_config.get_scheduler_config()
  config.update(
      prefill_policy=policy, preemption_mode=mode,
      max_num_seqs=draw(st.integers(1, 6)),
      max_num_batched_tokens=draw(st.integers(MAX_MODEL_LEN if policy == "none" else 1, 96)),
      chunk_size=draw(st.sampled_from([0, 1, 5, 16])),
      max_waiting=draw(st.integers(1, 8)), watermark=draw(st.sampled_from([0.0, 0.0, 0.2])),
      output_estimate=draw(st.sampled_from(["fixed", "fixed", "running_mean", "max_tokens"])),
      fixed_output_estimate=draw(st.integers(1, 8)),
      async_scheduling=async_scheduling, num_decode_steps=num_decode_steps)
  page_size = draw(st.sampled_from([1, 2, 4, 8]))
  num_pages = 1 + draw(st.integers(24, 128)) // page_size  # 24 to 128 tokens of KV
  return Scheduler(config, num_pages=num_pages, page_size=page_size,
                   max_model_len=MAX_MODEL_LEN, num_host_pages=draw(st.integers(0, 24)),
                   clock=lambda: 0.0)


def heavy_plan(seed: int, num_steps: int = 30) -> list:
  """Seeded bursty traffic: up to 3 arrivals a step, outputs longer than prompts, aborts."""
  rng = random.Random(seed)
  return [([Arrival(rng.randint(1, 24), rng.randint(4, 40), rng.randint(0, 3),
                    rng.random() < 0.3) for _ in range(rng.randint(0, 3))],
           [rng.randint(0, 99)] if rng.random() < 0.05 else [])
          for _ in range(num_steps)]


def traffic_engine(scheduler: Scheduler, seed: int) -> Engine:
  """An engine over the fake executor, as the scheduler's config says (async or not),
  checking every step as it is launched."""
  def sample(request_id: str, position: int) -> int:
    return (seed + zlib.crc32(request_id.encode()) + position * position) % 13

  def check(out: SchedulerOutput) -> None:
    in_flight = engine._in_flight  # the step before, while this one is launched
    check_step(scheduler, out, None if in_flight is None else in_flight[0])
    check_pages(scheduler)

  executor = FakeExecutor.for_pool(scheduler.page_pool, sample=sample, check=check)
  engine = Engine(scheduler, executor, async_scheduling=scheduler.config.async_scheduling)
  return engine


def run_traffic(scheduler: Scheduler, plan: list,
                seed: int) -> tuple[list[Request], FakeExecutor]:
  """Feeds `plan` (per step: arrivals, abort picks), steps until idle, checks everything;
  returns the admitted requests and the executor."""
  engine = traffic_engine(scheduler, seed)
  admitted: list[Request] = []
  aborted_by_test: set[str] = set()
  outputs: list[RequestOutput] = []
  plan = list(plan)
  num_steps = 0
  while plan or engine.has_unfinished():
    if plan:
      new, aborts = plan.pop(0)
      for arrival in new:
        stops = (STOP_TOKEN,) if arrival.stops else ()
        request, answer = engine.add_request(
            [5] * arrival.num_prompt, SamplingParams(arrival.max_tokens, stop_token_ids=stops),
            request_id=f"r{num_steps}-{len(admitted)}", priority=arrival.priority)
        if answer.admitted:
          admitted.append(request)
      live = sorted(scheduler.requests)
      for index in aborts:
        if live:
          aborted_by_test.add(live[index % len(live)])
          assert engine.abort(live.pop(index % len(live)))
    outputs.extend(engine.step())
    check_pages(scheduler)
    for request in admitted:
      assert request.num_output_tokens <= request.sampling.max_tokens
    num_steps += 1
    # Liveness: every admitted request gets through in a bounded number of steps.
    assert num_steps <= 40 + 30 * sum(r.num_prompt_tokens + r.sampling.max_tokens
                                      for r in admitted), "scheduler stopped making progress"
  check_drained(scheduler, admitted, aborted_by_test)
  check_outputs(engine, admitted, outputs, aborted_by_test)
  assert isinstance(engine.executor, FakeExecutor)
  return admitted, engine.executor


def check_drained(scheduler: Scheduler, admitted: list[Request], aborted: set[str]) -> None:
  """Idle: every page is back (device and host) and every request ended for a good reason."""
  bm = scheduler.page_pool
  assert bm.num_free_pages == bm.num_usable_pages and bm.num_free_host_pages == bm.num_host_pages
  assert scheduler.stats()["num_backlog_pages"] == 0
  mode = scheduler.config.preemption_mode
  for request in admitted:
    assert request.status is RequestStatus.FINISHED and request.page_ids == []
    if request.request_id in aborted and request.finish_reason == "aborted":
      continue
    # Only the abort policy may end a request early: under recompute and swap a running
    # request never fails because another one grew.
    allowed = {"length", "stop"} | ({"preempted"} if mode == "abort" else set())
    assert request.finish_reason in allowed, (request.request_id, request.finish_reason)
    if request.finish_reason == "length":
      assert request.num_output_tokens == request.sampling.max_tokens
    if request.finish_reason == "stop":
      assert request.output_ids[-1] == STOP_TOKEN


def check_outputs(engine: Engine, admitted: list[Request], outputs: list[RequestOutput],
                  aborted: set[str]) -> None:
  """Every token is the model's and streamed once, in order; every request ends once;
  every launched step was collected."""
  executor = engine.executor
  assert isinstance(executor, FakeExecutor)
  assert engine._in_flight is None
  assert executor.in_flight == 0 and executor.num_submitted == executor.num_collected
  for request in admitted:
    prompt_len = request.num_prompt_tokens
    assert request.output_ids == [expected_token(request, prompt_len + i, executor.sample)
                                  for i in range(request.num_output_tokens)]
    assert request.event_kinds().count("finished") == 1
    mine = [o for o in outputs if o.request_id == request.request_id]
    assert [t for o in mine for t in o.new_token_ids] == request.output_ids
    ends = [o.finished for o in mine].count(True)
    if request.request_id in aborted:
      assert ends <= 1  # an abort after the last step is never echoed by a step
    else:
      assert ends == 1 and mine[-1].finished
    if request.finish_reason == "stop":
      assert STOP_TOKEN not in request.output_ids[:-1]


@settings(max_examples=40, deadline=None)
@given(data=st.data(), policy=st.sampled_from(policy.PREFILL_POLICIES),
       mode=st.sampled_from(policy.PREEMPTION_MODES), plan=plans,
       seed=st.integers(0, 2**16))
def test_random_traffic_keeps_every_invariant(data, policy, mode, plan, seed):
  run_traffic(make_scheduler(data.draw, policy, mode), plan, seed)


# (async scheduling, decode iterations per launch): every loop the engine can run.
LOOPS = {"sync": (False, 1), "async": (True, 1), "sync-4-step": (False, 4),
         "async-4-step": (True, 4)}


@pytest.mark.parametrize("policy", policy.PREFILL_POLICIES)
@pytest.mark.parametrize("mode", policy.PREEMPTION_MODES)
@pytest.mark.parametrize("loop", LOOPS)
@settings(max_examples=15, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_heavy_traffic_keeps_every_invariant(policy, mode, loop, data, seed):
  scheduler = make_scheduler(data.draw, policy, mode, LOOPS[loop])
  _, executor = run_traffic(scheduler, heavy_plan(seed), seed)
  event(f"preempted: {bool(scheduler.stats()['num_preemptions'])}")
  event(f"multi-step launches: {bool(executor.num_multi_step_launches)}")
  event(f"tokens fed from the device: {bool(executor.num_fed_from_device)}")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("mode", policy.PREEMPTION_MODES)
@pytest.mark.parametrize("policy", policy.PREFILL_POLICIES)
def test_heavy_traffic_really_preempts(policy, mode, async_scheduling):
  """The random tests are not vacuous: this pressure preempts in every mode and policy."""
  config = scheduler_config.get_scheduler_config()
  config.update(prefill_policy=policy, preemption_mode=mode, max_num_seqs=6,
                max_num_batched_tokens=MAX_MODEL_LEN, chunk_size=16, watermark=0.0,
                output_estimate="fixed", fixed_output_estimate=1, max_waiting=8,
                async_scheduling=async_scheduling)
  scheduler = Scheduler(config, num_pages=1 + 64 // 4, page_size=4,
                        max_model_len=MAX_MODEL_LEN, num_host_pages=16, clock=lambda: 0.0)
  swap_copies = []
  original_schedule = scheduler.schedule

  def schedule_and_record():
    out = original_schedule()
    swap_copies.extend(out.swap_out + out.swap_in)
    return out

  scheduler.schedule = schedule_and_record
  admitted, _ = run_traffic(scheduler, heavy_plan(seed=1), seed=1)
  stats = scheduler.stats()
  assert len(admitted) >= 8 and stats["preemptions"][mode] > 0
  assert bool(swap_copies) == (mode == "swap")
