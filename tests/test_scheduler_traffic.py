"""Random traffic against tiny pools: the scheduler's invariants hold after every step.

Hypothesis draws the knobs (both prefill policies, all three preemption modes, pools
of a few pages that force pressure, small host pools, synchronous or async
scheduling, one or several decode iterations per launch) and a traffic plan
(arrivals with random lengths and priorities, stop tokens, aborts, resubmissions of a
live request's id and reuse of an aborted one's), and runs it
through an `Engine` over the tests' fake executor (`engine_utils.FakeExecutor`). The
fake plays the device: it writes (position, token, history of the tokens up to it)
into the KV slot of every computed token, performs the swap copies, and before each step checks that
every earlier position of the sequence still reads back what was written, and that
every token it is fed, placeholders of async scheduling included, is the model's.
That catches any page handed to two requests, any swap that lost a page, any
recompute that skipped a token and any token lost or fed twice — the cache content
itself is the oracle. Every submitted request must end in exactly one terminal state
(finished or rejected) and be reported exactly once.

`test_ten_thousand_steps` runs seeded plans until each prefill policy and preemption
mode has taken `STEPS_PER_CASE` steps over all four loops, so the default test run
steps the scheduler at least `MIN_TOTAL_STEPS` times.
"""

import collections
import dataclasses
import itertools
import random
import zlib

import pytest
from engine_utils import FakeExecutor, expected_token
from hypothesis import event, given, settings
from hypothesis import strategies as st

from configs import scheduler as scheduler_config
from kvpage.host import scheduler_config as policy
from kvpage.host.engine import Engine, RequestOutput
from kvpage.host.scheduler import Admission, Scheduler, SchedulerOutput
from kvpage.request import Request, RequestStatus, SamplingParams
from kvpage.units import NULL_PAGE

MAX_MODEL_LEN = 64
STOP_TOKEN = 0


def check_pages(scheduler: Scheduler) -> None:
  """free + owned = total; each page's ref count is its owners (prefix caching shares
  pages, never a free one); tables match requests; named pages are owned or evictable."""
  bm = scheduler.page_pool
  for tables, free, refs, total in (
      (bm.page_tables(), bm.free_page_ids(), bm.ref_counts(), range(1, bm.num_pages)),
      (bm.host_page_tables(), bm.free_host_page_ids(), bm.host_ref_counts(),
       range(bm.num_host_pages))):
    owners = collections.Counter(page for pages in tables.values() for page in pages)
    for pages in tables.values():
      assert len(pages) == len(set(pages)), "a page twice in one table"
    assert sorted(list(owners) + free) == list(total), "free + owned != total"
    assert all(refs[page] == count for page, count in owners.items()), "ref count != owners"
    assert (refs[free] == 0).all() and (refs >= 0).all()
  assert bm.ref_counts()[NULL_PAGE] == 0 and 0 <= bm.usage <= 1
  named = bm.prefix.named_pages() if bm.prefix is not None else {}
  assert len(set(named.values())) == len(named), "two pages under one name"
  assert bm.num_evictable_pages == sum(1 for page in named if bm.ref_counts()[page] == 0)
  if bm.prefix is None:  # without prefix caching no page is ever shared
    assert all(count == 1 for count in collections.Counter(
        page for pages in bm.page_tables().values() for page in pages).values())
  live = {rid: r for rid, r in scheduler.requests.items()}
  assert set(bm.page_tables()) <= {rid for rid, r in live.items() if r.status in (
      RequestStatus.RUNNING, RequestStatus.SWAPPED)}
  assert set(bm.host_page_tables()) <= {rid for rid, r in live.items()
                                        if r.status is RequestStatus.SWAPPED}
  for request in scheduler.running:
    assert request.page_ids == bm.page_table(request.request_id)
    assert len(request.page_ids) * bm.page_size >= request.num_computed_tokens
  for request in scheduler.swapped:  # only shared leading pages stay on the device
    assert request.page_ids == bm.page_table(request.request_id)
    assert all(bm.ref_counts()[page] >= 1 for page in request.page_ids)
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
  # Keyed by the request, not its id: the step in flight may hold an earlier request
  # whose id a new one reuses (it stopped or was aborted meanwhile).
  pending_before = {} if in_flight is None else {
      s.request: s.samples * s.num_steps for s in in_flight.scheduled}
  for seq in out.scheduled:
    request = seq.request
    # The last position the step computes: a multi-step decode adds an iteration each.
    last = seq.start_position + len(seq.token_ids) + seq.num_steps - 1
    assert request.num_computed_tokens == last  # committed when scheduled
    assert len(seq.page_ids) * scheduler.page_pool.page_size >= last
    # A sampling step's tokens are pending until update(): counted in num_tokens.
    assert (last == request.num_tokens - 1) if seq.samples else (last < request.num_tokens)
    assert request.num_pending == (seq.samples * seq.num_steps
                                   + pending_before.get(request, 0))
    assert request.num_sampled <= request.sampling.max_tokens  # no token past the end
    if config.prefill_policy == "none" and seq.is_prefill:
      # Whole prompts only, from the start or from a cached prefix's last whole page.
      page_size = scheduler.page_pool.page_size
      cached = scheduler.page_pool.prefix is not None
      assert seq.samples and (seq.start_position == 0
                              or (cached and seq.start_position % page_size == 0))
    if config.prefill_policy == "chunked" and config.chunk_size:
      assert len(seq.token_ids) <= config.chunk_size
    if seq.num_steps > 1:  # multi-step: decodes only, within the launch's iterations
      assert not seq.is_prefill and seq.num_steps <= out.num_steps
  assert out.num_steps <= config.num_decode_steps


# How an arrival picks its id: a fresh one, a live request's (a duplicate: 400), or one
# the test aborted earlier (reuse; a duplicate too if that id is live again).
FRESH, LIVE, ABORTED = "fresh", "live", "aborted"


@dataclasses.dataclass
class Arrival:
  num_prompt: int
  max_tokens: int
  priority: int
  stops: bool
  reuse: str = FRESH


arrivals = st.builds(Arrival, st.integers(1, 40), st.integers(1, 24), st.integers(0, 3),
                     st.booleans(), st.sampled_from([FRESH] * 6 + [LIVE, ABORTED]))
plans = st.lists(st.tuples(st.lists(arrivals, max_size=3), st.lists(st.integers(0, 99),
                                                                    max_size=1)),
                 min_size=1, max_size=25)


class Pick:
  """Knob choices from hypothesis (`draw`) or from a seeded `random.Random`."""

  def __init__(self, draw=None, rng: random.Random | None = None):
    self.draw, self.rng = draw, rng

  def integer(self, low: int, high: int) -> int:
    return self.rng.randint(low, high) if self.rng else self.draw(st.integers(low, high))

  def choice(self, options: list):
    return self.rng.choice(options) if self.rng else self.draw(st.sampled_from(options))


def make_scheduler(draw, policy: str, mode: str, loop: tuple[bool, int] | None = None
                   ) -> Scheduler:
  """Knobs biased towards pressure: small pools, optimistic output estimates. `draw`: a
  hypothesis draw or a `Pick`; `loop`: (async scheduling, decode iterations per launch),
  drawn when None."""
  pick = draw if isinstance(draw, Pick) else Pick(draw)
  async_scheduling, num_decode_steps = loop or (pick.choice([False, True]),
                                                pick.choice([1, 4]))
  config = scheduler_config.get_scheduler_config()
  config.update(
      prefill_policy=policy, preemption_mode=mode,
      max_num_seqs=pick.integer(1, 6),
      max_num_batched_tokens=pick.integer(MAX_MODEL_LEN if policy == "none" else 1, 96),
      chunk_size=pick.choice([0, 1, 5, 16]),
      max_waiting=pick.integer(1, 8), watermark=pick.choice([0.0, 0.0, 0.2]),
      output_estimate=pick.choice(["fixed", "fixed", "running_mean", "max_tokens"]),
      fixed_output_estimate=pick.integer(1, 8),
      async_scheduling=async_scheduling, num_decode_steps=num_decode_steps)
  page_size = pick.choice([1, 2, 4, 8])
  num_pages = 1 + pick.integer(24, 128) // page_size  # 24 to 128 tokens of KV
  # Every prompt is [5] * n (`submit`): with prefix caching, full pages are shared a lot.
  return Scheduler(config, num_pages=num_pages, page_size=page_size,
                   max_model_len=MAX_MODEL_LEN, num_host_pages=pick.integer(0, 24),
                   clock=lambda: 0.0, prefix_caching=pick.choice([False, True]))


def heavy_plan(seed: int, num_steps: int = 30) -> list:
  """Seeded bursty traffic: up to 3 arrivals a step, outputs longer than prompts, aborts,
  duplicate ids and ids reused after an abort."""
  rng = random.Random(seed)
  return [([Arrival(rng.randint(1, 24), rng.randint(4, 40), rng.randint(0, 3),
                    rng.random() < 0.3, rng.choice([FRESH] * 8 + [LIVE, ABORTED]))
            for _ in range(rng.randint(0, 3))],
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


STEPS: collections.Counter[str] = collections.Counter()  # scheduler steps per config
ID_CASES: collections.Counter[str] = collections.Counter()  # (id choice: answer) seen


def run_traffic(scheduler: Scheduler, plan: list,
                seed: int) -> tuple[list[Request], FakeExecutor]:
  """Feeds `plan` (per step: arrivals, abort picks), steps until idle, checks everything;
  returns the admitted requests and the executor."""
  engine = traffic_engine(scheduler, seed)
  submitted: list[Request] = []
  admitted: list[Request] = []
  aborted_by_test: set[Request] = set()
  outputs: list[RequestOutput] = []
  reported_rejections: list[Admission] = []
  engine.on_step = lambda output, *_: reported_rejections.extend(output.rejected)
  plan = list(plan)
  num_steps = 0
  while plan or engine.has_unfinished():
    if plan:
      new, aborts = plan.pop(0)
      for arrival in new:
        request = submit(engine, arrival, f"r{num_steps}-{len(submitted)}", aborted_by_test)
        submitted.append(request)
        if request.status is not RequestStatus.REJECTED:
          admitted.append(request)
      live = sorted(scheduler.requests)
      for index in aborts:
        if live:
          aborted_by_test.add(scheduler.requests[live[index % len(live)]])
          assert engine.abort(live.pop(index % len(live)))
    outputs.extend(engine.step())
    check_pages(scheduler)
    for request in admitted:
      assert request.num_output_tokens <= request.sampling.max_tokens
    num_steps += 1
    # Liveness: every admitted request gets through in a bounded number of steps.
    assert num_steps <= 40 + 30 * sum(r.num_prompt_tokens + r.sampling.max_tokens
                                      for r in admitted), "scheduler stopped making progress"
  config = scheduler.config
  STEPS[f"{config.prefill_policy}/{config.preemption_mode}"] += num_steps
  check_drained(scheduler, admitted, aborted_by_test)
  check_outputs(engine, admitted, outputs, aborted_by_test)
  check_terminal(submitted, reported_rejections)
  assert isinstance(engine.executor, FakeExecutor)
  return admitted, engine.executor


def submit(engine: Engine, arrival: Arrival, fresh_id: str, aborted: set[Request]) -> Request:
  """Submits `arrival` under the id its `reuse` asks for; a duplicate of a live id must be
  a 400 that leaves the live request untouched."""
  live = engine.scheduler.requests
  candidates = {LIVE: sorted(live), ABORTED: sorted({r.request_id for r in aborted}),
                FRESH: []}[arrival.reuse]
  request_id = candidates[arrival.num_prompt % len(candidates)] if candidates else fresh_id
  holder = live.get(request_id)
  before = None if holder is None else (holder.status, len(holder.events))
  stops = (STOP_TOKEN,) if arrival.stops else ()
  request, answer = engine.add_request(
      [5] * arrival.num_prompt, SamplingParams(arrival.max_tokens, stop_token_ids=stops),
      request_id=request_id, priority=arrival.priority)
  if holder is not None:
    assert answer.status == 400 and "duplicate" in answer.reason
    assert (holder.status, len(holder.events)) == before and live[request_id] is holder
  assert (request.status is RequestStatus.REJECTED) == (not answer.admitted)
  ID_CASES[f"{arrival.reuse}: {'duplicate' if holder else answer.status}"] += 1
  return request


def check_drained(scheduler: Scheduler, admitted: list[Request],
                  aborted: set[Request]) -> None:
  """Idle: every page is back (device and host) and every request ended for a good reason."""
  bm = scheduler.page_pool
  assert bm.num_free_pages == bm.num_usable_pages and bm.num_free_host_pages == bm.num_host_pages
  assert bm.num_evictable_pages == bm.num_cached_pages  # every named page free, none lost
  assert scheduler.stats()["num_backlog_pages"] == 0
  mode = scheduler.config.preemption_mode
  for request in admitted:
    assert request.status is RequestStatus.FINISHED and request.page_ids == []
    if request in aborted and request.finish_reason == "aborted":
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
                  aborted: set[Request]) -> None:
  """Every token is the model's and streamed once, in order; every admitted request ends
  once, reported once, even when its id was reused; every launched step was collected."""
  executor = engine.executor
  assert isinstance(executor, FakeExecutor)
  assert engine._in_flight is None
  assert executor.in_flight == 0 and executor.num_submitted == executor.num_collected
  # Per id, the outputs are the streams of its requests in admission order, each ended by
  # exactly one `finished` output.
  streams: dict[str, list[list[RequestOutput]]] = collections.defaultdict(lambda: [[]])
  for output in outputs:
    streams[output.request_id][-1].append(output)
    if output.finished:
      streams[output.request_id].append([])
  by_id: dict[str, list[Request]] = collections.defaultdict(list)
  for request in admitted:
    by_id[request.request_id].append(request)
  for request_id, requests in by_id.items():
    assert streams[request_id][-1] == [], f"{request_id}: outputs after its last end"
    assert len(streams[request_id]) - 1 == len(requests), f"{request_id}: ends != requests"
    for request, mine in zip(requests, streams[request_id], strict=False):
      check_stream(request, mine, executor)
  assert set(streams) <= set(by_id)


def check_stream(request: Request, mine: list[RequestOutput], executor: FakeExecutor) -> None:
  """One request's outputs: the model's tokens, in order, then one end with its reason."""
  prompt_len = request.num_prompt_tokens
  assert request.output_ids == [expected_token(request, prompt_len + i, executor.sample)
                                for i in range(request.num_output_tokens)]
  assert [t for o in mine for t in o.new_token_ids] == request.output_ids
  assert [o.finished for o in mine].count(True) == 1 and mine[-1].finished
  assert mine[-1].finish_reason == request.finish_reason
  if request.finish_reason == "stop":
    assert STOP_TOKEN not in request.output_ids[:-1]


def check_terminal(submitted: list[Request], reported: list[Admission]) -> None:
  """Every request ends in exactly one terminal state; each rejection is reported once."""
  for request in submitted:
    assert request.is_finished, (request.request_id, request.status)
    kinds = request.event_kinds()
    assert kinds.count("finished") + kinds.count("rejected") == 1, kinds
    assert (request.status is RequestStatus.REJECTED) == ("rejected" in kinds)
  rejected = collections.Counter(r.request_id for r in submitted
                                 if r.status is RequestStatus.REJECTED)
  assert collections.Counter(a.request_id for a in reported) == rejected


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


def test_an_id_reused_while_its_earlier_request_is_in_flight():
  """Found by the test above (seed 311, one running slot, async): request r13-19 stops
  while its next step is in flight, and a new request reusing the id is scheduled in
  the step after; its pending count is its own, not the earlier request's."""
  knobs = iter([1, 64, 0, 1, 0.0, "running_mean", 1, 1, 24, 0, False])
  scheduler = make_scheduler(lambda strategy: next(knobs), "none", "swap", (True, 1))
  run_traffic(scheduler, heavy_plan(311), 311)
  assert scheduler.page_pool.num_free_pages == scheduler.page_pool.num_usable_pages


def test_kept_pages_of_swapped_requests_never_block_the_resume_for_good():
  """Found by the heavy-traffic test (seed 233, sync-4-step, swap, prefix caching):
  with nothing running, the most important swapped request needs one page more than is
  free, and the missing page is one a less important swapped request kept on the device
  (a leading page it shared when swapped out). The scheduler stalled forever; now the
  keeper is requeued for recompute and both finish."""
  knobs = iter([4, 64, 0, 1, 0.0, "fixed", 1, 8, 56, 6, True])
  scheduler = make_scheduler(lambda strategy: next(knobs), "none", "swap", (False, 4))
  admitted, _ = run_traffic(scheduler, heavy_plan(233), 233)
  requeued = [r for r in admitted if "requeued" in r.event_kinds()]
  assert requeued and all(r.finish_reason in ("length", "stop") for r in requeued)


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


STEPS_PER_CASE = 1_700  # per prefill policy x preemption mode, over all four loops
MIN_TOTAL_STEPS = 10_000
assert STEPS_PER_CASE * len(policy.PREFILL_POLICIES) * len(policy.PREEMPTION_MODES) >= (
    MIN_TOTAL_STEPS)


@pytest.mark.parametrize("mode", policy.PREEMPTION_MODES)
@pytest.mark.parametrize("prefill", policy.PREFILL_POLICIES)
def test_ten_thousand_steps(prefill, mode):
  """Seeded plans, cycling through every loop, until this case has run its share of the
  `MIN_TOTAL_STEPS`; the six cases together run at least that many."""
  key = f"{prefill}/{mode}"
  start = STEPS[key]
  loops_run = set()
  for run in itertools.count():
    loop = list(LOOPS)[run % len(LOOPS)]
    seed = zlib.crc32(f"{key}/{run}".encode())
    rng = random.Random(seed)
    scheduler = make_scheduler(Pick(rng=rng), prefill, mode, LOOPS[loop])
    run_traffic(scheduler, heavy_plan(seed), seed)
    loops_run.add(loop)
    if STEPS[key] - start >= STEPS_PER_CASE and len(loops_run) == len(LOOPS):
      break
  assert STEPS[key] - start >= STEPS_PER_CASE
  # Not vacuous: live ids were resubmitted, and aborted ids reused and admitted.
  assert ID_CASES["live: duplicate"] and ID_CASES["aborted: 200"]
