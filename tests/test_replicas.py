"""Replicas: several engines stepped at once from threads, prompts spread by KV pages.

A request's tokens must not depend on which engine ran it or on what ran beside it;
prompts go to the engine with the fewest pages promised; a prompt no engine can take
is refused before anything runs; an engine's failure reaches the caller.
"""

import threading

import jax
import pytest
import tiny_config
from engine_utils import FakeExecutor, fake_engine

from kvpage import build
from kvpage.host.replicas import Replicas
from kvpage.request import RequestStatus, SamplingParams
from models import llama

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9], [2, 7, 1, 8], [6, 6, 6],
           [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [5]]
MAX_TOKENS = [7, 21, 10, 3, 12, 18]  # 21 crosses a page boundary of 16


def test_two_replicas_generate_the_tokens_one_engine_does():
  config = tiny_config.get_config()
  config.scheduler.watermark = 0.0
  params = llama.random_init(config.model, seed=0)
  samplings = [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
  one = build.jax_engine(llama, config.model, params, config.scheduler, num_pages=64,
                         page_size=16)
  expected = [r.output_ids for r in one.generate(PROMPTS, samplings)]
  replicas = build.jax_replicas(llama, config.model, params, config.scheduler, replicas=2,
                                num_pages=32, page_size=16)
  requests = replicas.generate(PROMPTS, samplings)
  assert [r.output_ids for r in requests] == expected  # in the caller's order
  assert all(r.status == RequestStatus.FINISHED for r in requests)
  assert len({r.request_id for r in requests}) == len(PROMPTS)
  for engine in replicas.engines:  # both worked, and gave every page back
    assert engine.executor.num_launches > 0
    pool = engine.scheduler.page_pool
    assert pool.num_free_pages == pool.num_usable_pages
  # One copy of the weights (the engines' executors hold the same device arrays) and
  # one jitted step, so each program compiled once for both.
  first, second = (jax.tree.leaves(e.executor.params) for e in replicas.engines)
  assert all(a is b for a, b in zip(first, second, strict=True))
  assert replicas.engines[0].executor.step is replicas.engines[1].executor.step


def test_prompts_go_to_the_replica_with_the_fewest_pages_promised():
  replicas = Replicas([fake_engine(page_size=4), fake_engine(page_size=4)])
  # Pages of 4 tokens: 8+8 -> 4 pages, 2+2 -> 1, 4+4 -> 2, 1+3 -> 1, 6+6 -> 3.
  prompts = [[1] * 8, [1] * 2, [1] * 4, [1], [1] * 6]
  samplings = [SamplingParams(max_tokens=n) for n in (8, 2, 4, 3, 6)]
  # Promised after each: (4, 0) -> (4, 1) -> (4, 3) -> (4, 4) -> (7, 4), first on ties.
  assert replicas.assign(prompts, samplings) == [0, 1, 1, 1, 0]


def test_a_prompt_no_replica_can_take_is_refused_before_anything_runs():
  engines = [fake_engine(num_pages=64, page_size=4, max_model_len=64) for _ in range(2)]
  replicas = Replicas(engines)
  prompts = [[1, 2, 3], [4, 5], [1] * 100]  # the third exceeds max_model_len
  with pytest.raises(ValueError, match="prompt 2 rejected by replica 0"):
    replicas.generate(prompts, SamplingParams(max_tokens=4))
  for engine in engines:
    assert not engine.has_unfinished()
    assert engine.executor.num_launches == 0


def test_a_prompt_one_replica_refuses_goes_to_the_next():
  """The door of `kvpage.host.routing`: round robin offers the first prompt to replica 0,
  whose pool is too small for it; replica 1 takes it."""
  small, large = fake_engine(num_pages=8, page_size=4), fake_engine(num_pages=64, page_size=4)
  replicas = Replicas([small, large], policy="round_robin")
  requests = replicas.generate([[1] * 60, [2, 3]], SamplingParams(max_tokens=4))
  assert [r.num_output_tokens for r in requests] == [4, 4]
  assert large.scheduler.stats()["num_admitted"] == 2  # (the second: its turn came first)
  assert sum(small.scheduler.stats()["rejections"].values()) == 1
  with pytest.raises(ValueError, match="unknown routing policy"):
    Replicas([small, large], policy="fastest")


class FailingExecutor(FakeExecutor):
  def submit(self, output):
    raise RuntimeError("device lost")


def test_an_engine_failure_reaches_the_caller_after_the_others_finish():
  healthy = fake_engine()
  broken = fake_engine()
  broken.executor = FailingExecutor.for_pool(broken.scheduler.page_pool)
  replicas = Replicas([healthy, broken])
  threads_before = threading.active_count()
  with pytest.raises(RuntimeError, match="device lost"):
    replicas.generate([[1, 2, 3], [4, 5, 6]], SamplingParams(max_tokens=5))
  assert not healthy.has_unfinished()  # its request ran to the end
  assert threading.active_count() == threads_before  # no thread left behind


def test_replicas_need_distinct_engines():
  engine = fake_engine()
  with pytest.raises(ValueError, match="at least one engine"):
    Replicas([])
  with pytest.raises(ValueError, match="distinct engines"):
    Replicas([engine, engine])
  with pytest.raises(ValueError, match="replicas must be an integer >= 1"):
    build.jax_replicas(llama, tiny_config.get_config().model, {}, None, replicas=0,
                       num_pages=8, page_size=16)
