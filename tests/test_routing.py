"""The fleet's routing policies (`kvpage.host.routing`), on made-up snapshots and on a
real scheduler's: each ranks every replica, counts what it sent between snapshots, and
prefix affinity speaks the prefix cache's page names."""

import pytest
from engine_utils import FakeExecutor

from configs import scheduler as scheduler_lib
from kvpage.host.engine import Engine
from kvpage.host.routing import (
  POLICIES,
  ReplicaStats,
  Router,
  RouteRequest,
  prompt_hashes,
  replica_stats,
  route,
)
from kvpage.host.scheduler import Scheduler
from kvpage.interface import Admission
from kvpage.request import Request, SamplingParams

SMALL = RouteRequest(num_prompt_tokens=30, max_tokens=2)  # 2 pages of 16


def fleet(**per_replica) -> list[ReplicaStats]:
  return [ReplicaStats(name, **fields) for name, fields in per_replica.items()]


def test_every_policy_ranks_every_replica():
  stats = fleet(a={}, b={}, c={})
  for policy in POLICIES:
    router = Router(policy)
    router.update(stats)
    assert sorted(router.rank(SMALL)) == ["a", "b", "c"], policy
  with pytest.raises(ValueError, match="unknown routing policy 'random'"):
    Router("random")


def test_round_robin_takes_each_in_turn():
  router = Router("round_robin")
  router.update(fleet(a={}, b={}, c={}))
  assert [router.rank(SMALL)[0] for _ in range(4)] == ["a", "b", "c", "a"]


def test_least_requests_picks_the_lighter_of_two_and_counts_what_it_sent():
  router = Router("least_requests", seed=1)
  router.update(fleet(a=dict(num_running=5), b=dict(num_running=1)))
  assert router.rank(SMALL)[0] == "b"  # two replicas: both drawn, the lighter first
  chosen = []
  for _ in range(6):  # a burst between snapshots: b fills up as the router sends
    chosen.append(router.rank(SMALL)[0])
    router.sent(chosen[-1], SMALL)
  assert chosen[:4] == ["b"] * 4  # until b has as many as a
  assert router.requests("a") == router.requests("b") == 6  # then they even out
  router.update(fleet(a=dict(num_running=6), b=dict(num_running=6)))
  assert router.requests("b") == 6  # the snapshot holds what was sent: counts restart


def test_kv_headroom_ranks_by_room_left_after_promises_and_what_was_sent():
  router = Router("kv_headroom")
  router.update(fleet(a=dict(headroom_pages=10), b=dict(headroom_pages=14, promised_pages=6),
                      c=dict(headroom_pages=12)))
  assert router.rank(SMALL) == ["c", "a", "b"]  # room after promises: 12, 10, 8
  big = RouteRequest(num_prompt_tokens=60, max_tokens=4)  # 4 pages
  order = []
  for _ in range(4):
    first = router.rank(big)[0]
    router.sent(first, big)
    order.append(first)
  assert order == ["c", "a", "b", "c"]  # room for it: c 8, a 6, then b and c 4 (a tie)
  assert router.headroom("c", big) == 12 - 8 - 4


def test_prefix_affinity_goes_where_the_prefix_is_unless_that_costs_too_much():
  prompt = list(range(100, 150))  # 3 full pages of 16 before the last token
  request = RouteRequest(len(prompt), 4, prompt_hashes(prompt, 16))
  assert len(request.page_hashes) == 3
  held = frozenset(request.page_hashes[:2])
  router = Router("prefix_affinity", headroom_margin_pages=5, wait_margin_s=1.0)
  router.update(fleet(a=dict(headroom_pages=20), b=dict(headroom_pages=17, prefix_pages=held)))
  assert router.rank(request) == ["b", "a"]  # 3 pages less room, within the margin
  router.update(fleet(a=dict(headroom_pages=30), b=dict(headroom_pages=17, prefix_pages=held)))
  assert router.rank(request) == ["a", "b"]  # 13 pages less: kv_headroom instead
  router.update(fleet(a=dict(headroom_pages=20),
                      b=dict(headroom_pages=20, wait_s=2.5, prefix_pages=held)))
  assert router.rank(request) == ["a", "b"]  # a wait 2.5 s longer than the best
  router.update(fleet(a=dict(headroom_pages=20), b=dict(headroom_pages=17)))
  assert router.rank(request) == ["a", "b"]  # nobody holds it: kv_headroom


def test_a_schedulers_snapshot_names_the_pages_the_router_looks_for():
  config = scheduler_lib.get_scheduler_config()
  scheduler = Scheduler(config, num_pages=64, page_size=16, max_model_len=512,
                        prefix_caching=True, clock=lambda: 0.0)
  engine = Engine(scheduler, FakeExecutor.for_pool(scheduler.page_pool))
  prompt = list(range(1, 60))
  engine.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))
  stats = replica_stats("r0", scheduler)
  request = RouteRequest(len(prompt), 2, prompt_hashes(prompt, 16))
  assert set(request.page_hashes) <= stats.prefix_pages and len(request.page_hashes) == 3
  assert (stats.num_running, stats.num_waiting, stats.promised_pages) == (0, 0, 0)
  assert stats.headroom_pages == int(63 - 0.15 * 63)  # all free, less the watermark
  router = Router("prefix_affinity")
  router.update([stats, ReplicaStats("r1", headroom_pages=stats.headroom_pages)])
  assert router.rank(request)[0] == "r0"


def answers(**by_replica):
  """`admit` for `route`: each replica's answer, and the order they were asked."""
  asked = []

  def admit(replica_id):
    asked.append(replica_id)
    return by_replica[replica_id]

  return admit, asked


def test_the_door_tries_replicas_in_rank_order_until_one_admits():
  router = Router("kv_headroom")
  router.update(fleet(a=dict(headroom_pages=20), b=dict(headroom_pages=10)))
  admit, asked = answers(a=Admission(503, "full", 2.0, cause="kv_pressure"), b=Admission(200))
  routed = route(router, SMALL, admit)
  assert routed.replica_id == "b" and routed.answer.admitted and asked == ["a", "b"]
  assert router.headroom("b", SMALL) == 10 - 2 - 2 and router.headroom("a", SMALL) == 18


def test_the_door_pushes_back_only_when_every_replica_refuses():
  router = Router("round_robin")
  router.update(fleet(a={}, b={}))
  admit, asked = answers(a=Admission(503, "kv", 3.0, cause="kv_pressure"),
                         b=Admission(429, "queue", 1.5, cause="queue_full"))
  routed = route(router, SMALL, admit)
  assert routed.replica_id is None and asked == ["a", "b"]
  assert (routed.answer.status, routed.answer.retry_after) == (503, 1.5)  # mixed: 503
  assert routed.answer.cause == "queue_full" and "every replica refused (2)" in \
      routed.answer.reason
  admit, _ = answers(a=Admission(429, "q", 4.0), b=Admission(429, "q", None))
  assert route(router, SMALL, admit).answer.status == 429  # they agree: theirs


def test_a_request_one_replica_refuses_is_served_by_the_other():
  def scheduler(num_pages):
    return Scheduler(scheduler_lib.get_scheduler_config(), num_pages=num_pages, page_size=16,
                     max_model_len=512, clock=lambda: 0.0)

  schedulers = {"small": scheduler(8), "large": scheduler(64)}
  prompt = list(range(1, 100))  # 99 + 28 tokens: 8 pages, more than the small pool holds
  request = RouteRequest(len(prompt), 28)

  def admit(replica_id):
    return schedulers[replica_id].add_request(
        Request(f"r@{replica_id}", prompt, SamplingParams(max_tokens=28)))

  router = Router("round_robin")  # asks the small one first
  router.update([replica_stats(name, s) for name, s in schedulers.items()])
  routed = route(router, request, admit)
  assert [(name, answer.status) for name, answer in routed.tried] == [("small", 400),
                                                                        ("large", 200)]
  assert routed.replica_id == "large" and schedulers["large"].num_waiting == 1
  admit_bad, asked = answers(small=Admission(400, "bad", cause="invalid_token_ids"),
                             large=Admission(200))
  router = Router("round_robin")
  router.update([replica_stats(name, s) for name, s in schedulers.items()])
  routed = route(router, request, admit_bad)  # a fault of the request's own: no retry
  assert routed.answer.status == 400 and len(asked) == 1
