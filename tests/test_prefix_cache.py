"""Automatic prefix caching: named full pages, shared by later requests, evicted last-used last.

The fake executor (`engine_utils.FakeExecutor`) checks every cached position a step
reads against the tokens that lead to it, so a wrongly shared page fails there; the
real tiny model's greedy tokens must not change with caching on.
"""

import json
import pathlib
import random
import subprocess
import sys

import pytest
import tiny_config
from engine_utils import FakeExecutor
from test_scheduler_traffic import Pick, check_pages, heavy_plan, make_scheduler, run_traffic

from configs import llama_13b
from configs import scheduler as scheduler_lib
from kvpage import build, model_shape
from kvpage.host import prefix_cache
from kvpage.host.engine import Engine
from kvpage.host.pages import PagePool
from kvpage.host.scheduler import Scheduler
from kvpage.metrics import MetricsRecorder
from kvpage.request import SamplingParams
from kvpage.serve.metrics import ServerMetrics
from kvpage.sim import capacity, workload
from models import llama

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = 4


def test_a_page_is_named_by_its_tokens_and_everything_before_them():
  first = prefix_cache.page_hash(None, [1, 2, 3, 4])
  assert prefix_cache.page_hash(None, [1, 2, 3, 4]) == first
  assert prefix_cache.page_hash(None, [1, 2, 3, 5]) != first
  second = prefix_cache.page_hash(first, [5, 6, 7, 8])
  assert second != prefix_cache.page_hash(prefix_cache.page_hash(None, [0, 2, 3, 4]),
                                          [5, 6, 7, 8])


def _pool_with_named(tokens: list[int], num_pages: int = 9) -> tuple[PagePool, list[bytes]]:
  pool = PagePool(num_pages, PAGE, prefix_caching=True)
  hashes = _hashes(tokens)
  pool.allocate("a", len(tokens))
  pool.name_pages("a", hashes, len(hashes))
  return pool, hashes


def _hashes(tokens: list[int]) -> list[bytes]:
  hashes: list[bytes] = []
  for start in range(0, len(tokens) - PAGE + 1, PAGE):
    hashes.append(prefix_cache.page_hash(hashes[-1] if hashes else None,
                                         tokens[start:start + PAGE]))
  return hashes


def test_shared_pages_are_counted_once_and_freed_last_owner_first():
  pool, hashes = _pool_with_named(list(range(1, 11)))  # 10 tokens: 2 full pages, 1 partial
  a = pool.page_table("a")
  assert pool.num_cached_pages == 2 and pool.num_evictable_pages == 0
  hits = pool.cached_prefix(hashes, max_pages=9)
  assert hits == a[:2] and pool.num_shared(hits) == 2
  pool.allocate("b", 12, prefix_pages=hits)  # shares 2, takes 1 new
  b = pool.page_table("b")
  assert b[:2] == a[:2] and b[2] not in a
  assert pool.ref_counts()[a[:2]].tolist() == [2, 2]
  assert pool.num_used_pages == 4
  pool.free("a")
  assert pool.num_used_pages == 3 and pool.num_evictable_pages == 0  # b still holds them
  pool.free("b")
  assert pool.num_free_pages == pool.num_usable_pages
  assert pool.num_evictable_pages == 2 == pool.num_cached_pages


def test_an_evictable_page_comes_back_on_a_hit_and_is_evicted_only_when_handed_out():
  pool, hashes = _pool_with_named(list(range(1, 9)))  # 2 full pages
  named = pool.page_table("a")[:2]
  pool.free("a")
  # Freed tail first: the prefix's end is evicted before its start.
  assert pool.free_page_ids()[-2:] == named[::-1]
  assert pool.can_allocate(8, pool.cached_prefix(hashes, 2))
  pool.allocate("b", 9, prefix_pages=pool.cached_prefix(hashes, 2))
  assert pool.page_table("b")[:2] == named and pool.num_evictable_pages == 0
  pool.free("b")
  # Filling the whole pool evicts both names (least recently freed first).
  pool.allocate("c", PAGE * pool.num_usable_pages)
  assert pool.num_cached_pages == 0 and pool.prefix.stats.evicted_pages == 2
  assert pool.cached_prefix(hashes, 2) == []


def test_a_swap_out_keeps_the_shared_pages_and_copies_only_its_own():
  hashes = _hashes(list(range(1, 9)))
  pool = PagePool(12, PAGE, num_host_pages=8, prefix_caching=True)
  pool.allocate("a", 8)
  pool.name_pages("a", hashes, 2)
  pool.allocate("b", 14, prefix_pages=pool.cached_prefix(hashes, 2))
  shared, own = pool.page_table("b")[:2], pool.page_table("b")[2:]
  assert pool.num_kept_on_swap("b") == 2
  copies = pool.swap_out("b")
  assert [device for device, _ in copies] == own  # the shared pages are not copied
  assert pool.page_table("b") == shared and len(pool.host_table("b")) == 2
  back = pool.swap_in("b")
  assert pool.page_table("b")[:2] == shared and len(back) == 2
  pool.free("a")
  pool.free("b")
  assert pool.num_free_pages == pool.num_usable_pages
  assert pool.num_free_host_pages == pool.num_host_pages


def _fake_engine(num_pages=64, num_host_pages=0, **knobs) -> Engine:
  config = scheduler_lib.get_scheduler_config()
  config.update(dict(watermark=0.0, **knobs))
  scheduler = Scheduler(config, num_pages=num_pages, page_size=PAGE, max_model_len=256,
                        num_host_pages=num_host_pages, clock=lambda: 0.0,
                        prefix_caching=True)
  return Engine(scheduler, FakeExecutor.for_pool(scheduler.page_pool),
                async_scheduling=config.async_scheduling)


def _first_start(request) -> int:
  return next(e.detail["num_computed_tokens"] for e in request.events if e.kind == "scheduled")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_later_request_computes_only_what_is_not_cached(async_scheduling):
  engine = _fake_engine(async_scheduling=async_scheduling)
  prompt = list(range(1, 41))  # 10 full pages
  sampling = SamplingParams(max_tokens=6, ignore_eos=True)
  first = engine.generate([prompt], sampling)[0]
  second, third = engine.generate([prompt, prompt[:22] + [99] * 18], sampling)
  # The last prompt token is always computed: 9 whole pages of the 10 are reused.
  assert _first_start(first) == 0 and _first_start(second) == 36
  assert _first_start(third) == 20  # 5 pages in common, up to the 21st token
  stats = engine.scheduler.stats()
  assert stats["prefix_hit_tokens"] == 56 and stats["prefix_query_tokens"] == 120
  check_pages(engine.scheduler)  # the fake executor checked every reused position
  assert [r.finish_reason for r in (first, second, third)] == ["length"] * 3


def test_running_requests_share_pages_and_admission_counts_only_new_ones():
  engine = _fake_engine()
  scheduler = engine.scheduler
  prompt = list(range(1, 33))  # 8 full pages
  long = SamplingParams(max_tokens=40, ignore_eos=True)
  leader, _ = engine.add_request(prompt, long)
  engine.step()
  engine.step()  # its prompt's pages are named once the step that computed them is back
  follower, _ = engine.add_request([*prompt, 7, 7], long)
  pages_alone = scheduler.page_pool.pages_for(34 + 40)
  assert scheduler.admission.estimate_pages(follower) == pages_alone - 8
  engine.step()
  assert follower.page_ids[:8] == leader.page_ids[:8]
  assert scheduler.page_pool.ref_counts()[leader.page_ids[:8]].tolist() == [2] * 8
  engine.run_until_done()
  assert scheduler.page_pool.num_evictable_pages == scheduler.page_pool.num_cached_pages


@pytest.mark.parametrize("mode", ["recompute", "swap", "abort"])
def test_heavy_traffic_with_shared_prompts_hits_and_keeps_every_invariant(mode):
  """Every prompt of the traffic tests is [5] * n: under pressure, pages are shared,
  evicted, kept through swaps and recomputed; `run_traffic` checks every step."""
  hits = evictions = 0
  for seed in range(12):
    rng = random.Random(seed)
    loop = (rng.random() < 0.5, rng.choice([1, 4]))
    scheduler = make_scheduler(Pick(rng=rng), rng.choice(["none", "chunked"]), mode, loop)
    if scheduler.page_pool.prefix is None:
      continue
    run_traffic(scheduler, heavy_plan(seed, num_steps=40), seed)
    stats = scheduler.page_pool.prefix.stats
    hits += stats.hit_tokens
    evictions += stats.evicted_pages
  assert hits > 0 and evictions > 0


PROMPT_GROUPS = [[(11 * g + 3 * j) % 500 + 1 for j in range(36)] for g in range(2)]


def _shared_prefix_prompts(seed: int) -> list[list[int]]:
  rng = random.Random(seed)
  return [PROMPT_GROUPS[rng.randrange(2)][:rng.randint(20, 36)]
          + [rng.randrange(1, 500) for _ in range(rng.randint(1, 12))] for _ in range(8)]


@pytest.mark.parametrize("mode,async_scheduling,num_decode_steps",
                         [("recompute", True, 1), ("swap", True, 4), ("abort", False, 4),
                          ("swap", False, 1)])
def test_greedy_tokens_do_not_change_with_prefix_caching(mode, async_scheduling,
                                                         num_decode_steps):
  """The real tiny model over a small pool, prompts from two shared prefixes arriving two
  at a time: caching on and off give the same tokens (an aborted request's are a
  prefix of the other run's)."""
  config = tiny_config.get_config()
  config.scheduler.update(dict(preemption_mode=mode, watermark=0.0, output_estimate="fixed",
                               fixed_output_estimate=1, num_host_pages=24,
                               async_scheduling=async_scheduling,
                               num_decode_steps=num_decode_steps,
                               prefill_policy="chunked", chunk_size=16,
                               admission="queue_only"))  # all admitted; preemption copes
  params = llama.random_init(config.model, config.seed)
  prompts = _shared_prefix_prompts(seed=len(mode) + num_decode_steps)
  sampling = SamplingParams(max_tokens=16, ignore_eos=True)
  outputs, stats = {}, {}
  for caching in (False, True):
    engine = build.jax_engine(llama, config.model, params, config.scheduler, num_pages=14,
                              page_size=8, num_host_pages=24, prefix_caching=caching)
    requests = []
    for i in range(0, len(prompts), 2):  # two arrivals every third step
      for prompt in prompts[i:i + 2]:
        request, answer = engine.add_request(prompt, sampling)
        assert answer.admitted, answer
        requests.append(request)
      for _ in range(3):
        engine.step()
    engine.run_until_done()
    outputs[caching] = [r.output_ids for r in requests]
    stats[caching] = engine.scheduler.stats()
  assert stats[True]["prefix_hit_tokens"] > 0
  assert sum(stats[caching]["num_preemptions"] for caching in stats) > 0
  for off, on in zip(outputs[False], outputs[True], strict=True):
    if mode == "abort":
      shorter = min(len(off), len(on))
      assert off[:shorter] == on[:shorter]
    else:
      assert off == on and len(on) == 16


def test_metrics_report_lookups_hits_and_cached_pages():
  engine = _fake_engine()
  recorder = MetricsRecorder(engine.scheduler, lambda: 0.0)
  server = ServerMetrics(engine.scheduler, lambda: 0.0, "fake")

  def on_step(*args):
    recorder.on_step(*args)
    server.on_step(*args)

  engine.on_step = on_step
  prompt = list(range(1, 41))
  for _ in range(2):  # the second finds the first's prompt pages
    recorder.track(engine.add_request(prompt, SamplingParams(max_tokens=4,
                                                             ignore_eos=True))[0])
    engine.run_until_done()
  summary = recorder.summary({})
  assert summary["prefix_cache"]["hit_tokens"] == 36
  assert summary["prefix_cache"]["query_tokens"] == 80
  assert summary["prefill_tokens_computed"] == 44 and summary["recomputed_tokens"] == 0
  assert sum(row.get("prefix_hit_tokens", 0) for row in recorder.steps) == 36
  assert recorder.steps[-1]["num_cached_pages"] == engine.scheduler.page_pool.num_cached_pages
  text = server.render().decode()
  assert 'kvpage:prefix_cache_hits_total{model_name="fake"} 36.0' in text
  assert 'kvpage:prefix_cache_queries_total{model_name="fake"} 80.0' in text
  assert "kvpage:prefix_cache_evictable_pages" in text


def test_a_shared_prefix_workload_puts_one_of_the_prefixes_before_each_prompt():
  common = dict(num_requests=40, arrival_rate=10.0, prompt_len="uniform:3:9", output_len="4",
                vocab_size=500, seed=3)
  plain = workload.synthesize(**common)
  shared = workload.synthesize(**common, shared_prefix="32:3")
  assert shared == workload.synthesize(**common, shared_prefix="32:3")  # seeded
  prefixes = {item.prompt_ids[:32] for item in shared}
  assert len(prefixes) == 3
  for before, after in zip(plain, shared, strict=True):  # the rest of the trace unchanged
    assert after.prompt_ids[32:] == before.prompt_ids
    assert (after.arrival_time, after.output_len) == (before.arrival_time, before.output_len)
  for spec in ("32", "a:b", "0:3", "32:0"):
    with pytest.raises(ValueError, match="shared prefix"):
      workload.synthesize(**common, shared_prefix=spec)


def test_the_capacity_report_counts_shared_prefix_pages_once():
  model = model_shape.ModelShape.from_config(llama_13b.get_config().model)
  plan = capacity.plan(model, seq_len=1536, memory_bytes=80 * 2**30, weight_dtype="fp16",
                       kv_dtype="fp16", page_size=16)
  shared = 1024 // 16
  expected = (plan.pool_pages - 8 * shared) // (plan.pages_per_request - shared)
  assert capacity.requests_with_shared_prefix(plan, 1024, 8) == expected
  assert expected > 2 * plan.max_concurrent_requests
  # A prefix as long as the request still leaves its last token to compute.
  assert capacity.requests_with_shared_prefix(plan, 1536, 1) == (
      plan.pool_pages - 95) // 1
  result = subprocess.run([sys.executable, "-m", "experiments.capacity", "--seq_len=1536",
                           "--shared_prefix=1024:8", "--json"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  record = json.loads(result.stdout)
  assert record["shared_prefix"]["max_concurrent_requests"] > 2 * record[
      "max_concurrent_requests"]


def test_a_conversation_turn_repeats_the_whole_history_before_its_new_message():
  trace = workload.synthesize(num_requests=5, arrival_rate=2.0, prompt_len="uniform:4:12",
                              output_len="uniform:2:6", vocab_size=300, seed=1)
  turns = workload.conversations(trace, turns=3, gap_s=1.5, vocab_size=300, seed=1)
  assert turns == workload.conversations(trace, turns=3, gap_s=1.5, vocab_size=300, seed=1)
  assert len(turns) == 15 and [t.arrival_time for t in turns] == sorted(
      t.arrival_time for t in turns)
  by_id = {t.request_id: t for t in turns}
  for item in trace:
    first, second, third = (by_id[f"{item.request_id}-turn{k}"] for k in range(3))
    assert first.prompt_ids == item.prompt_ids and second.arrival_time == item.arrival_time + 1.5
    opening, output = len(item.prompt_ids), item.output_len
    assert second.prompt_ids[:opening] == item.prompt_ids
    assert len(second.prompt_ids) == 2 * opening + output
    assert third.prompt_ids[:len(second.prompt_ids)] == second.prompt_ids
  for spec in ("3", "x:1", "0:1", "2:-1"):
    with pytest.raises(ValueError, match="conversation"):
      workload.parse_conversation(spec)
