"""The fleet study: what it reports of a run holds on hand-built cases (the door's
answers, the pools over time, as the fleet's summary counts them); each claim can hold,
fail and be undecided on a table made for it, and is undecided where the seeds disagree;
and a small run on the simulator writes its figures and study.json with its premises, its
SLOs, a row per policy and a verdict per claim, and resumes without running again."""

import dataclasses
import json
import types

import pytest

from experiments import fleet_study
from kvpage.host import routing
from kvpage.interface import Admission
from kvpage.sim import fleet
from kvpage.sim.workload import TraceRequest

OK = Admission(200, "admitted")
FULL = Admission(503, "cache pressure", 1.0, cause="kv_pressure")
SLOW = Admission(429, "forecast wait", 0.5, cause="wait_forecast")
EMPTY = Admission(400, "empty prompt", cause="empty_prompt")


def routed(*answers: Admission) -> routing.Routed:
  """The door's outcome when replicas r0, r1, ... answer `answers` in that order (the
  real door, `routing.route`, over a round-robin router starting at r0)."""
  names = [f"r{i}" for i in range(len(answers))]
  router = routing.Router("round_robin")
  router.update([routing.ReplicaStats(name) for name in names])
  given = dict(zip(names, answers, strict=True))
  return routing.route(router, routing.RouteRequest(100, 10), lambda name: given[name])


class Replica:
  """What the fleet's summary reads of a replica's `MetricsRecorder`: its steps (time, KV
  use), its clock at the end, its scheduler's counters and a row per request (here each
  request is its row)."""

  start_time = 0.0

  def __init__(self, steps=(), end=10.0):
    self.steps = [dict(time=time, kv_usage=usage) for time, usage in steps]
    self.end = end
    self.scheduler = types.SimpleNamespace(stats=lambda: dict(num_preemptions=0))

  def clock(self):
    return self.end

  def request_row(self, request):
    return dict(request)


def summary(routes, replicas=None):
  """`fleet.summarize` of one arrival per door outcome in `routes` (served ones finished
  within any SLO), over `replicas` (default: three idle ones)."""
  replicas = replicas or {name: Replica() for name in ("r0", "r1", "r2")}
  arrivals = []
  for i, route in enumerate(routes):
    row = dict(request_id=f"q{i}", prompt_tokens=100, output_tokens=10, itl_s=[],
               queue_wait_s=0.0, ttft_s=0.1, tpot_s=0.01, e2e_s=1.0,
               rejected_status=None, reject_reason=None,
               status="finished" if route.replica_id else "rejected",
               finish_reason="length" if route.replica_id else None)
    arrivals.append(fleet.FleetRequest(TraceRequest(f"q{i}", 0.0, (1, 2), 10), route,
                                       row if route.replica_id else None,
                                       {name: row for name, _ in route.tried}))
  return fleet.summarize(arrivals, replicas, premises={})[0]


def test_a_refusal_counts_as_refused_while_room_when_another_replica_admits():
  routes = [
      routed(OK, FULL, FULL),  # the first asked took it: nobody refused it
      routed(FULL, OK, FULL),  # r0 refused while r1 had room: one arrival, one retry
      routed(SLOW, FULL, OK),  # two refusals, then room: one arrival, two retries
      routed(FULL, FULL, FULL),  # every replica refused: no replica had room
      routed(FULL, SLOW, FULL),  # ... r1 had KV room, but its forecast wait refused it
      routed(EMPTY, OK, OK),  # the request's own fault: answered at once, no retry
  ]
  assert [route.replica_id for route in routes] == ["r0", "r1", "r2", None, None, None]
  counted = summary(routes)
  assert {key: counted[key] for key in ("refused_while_room", "door_retries", "num_rejected",
                                        "rejections", "refused_with_kv_room")} == dict(
      refused_while_room=2, door_retries=3, num_rejected=3, rejections={"503": 2, "400": 1},
      refused_with_kv_room=1)
  read = {name: fleet_study.FIGURES[name](counted)
          for name in ("refused_while_room_fraction", "rejected_fraction", "rejected_503")}
  assert read == dict(refused_while_room_fraction=2 / 6, rejected_fraction=0.5, rejected_503=2)
  assert fleet_study.FIGURES["goodput_fraction"](counted) == 0.5


def test_pool_imbalance_compares_the_fullest_pool_with_the_mean_over_time():
  def pools(*steps):
    return summary([routed(OK)], {f"r{i}": Replica(s) for i, s in enumerate(steps)})

  even = pools([(0.0, 0.5)], [(0.0, 0.5)])
  assert fleet_study.FIGURES["pool_imbalance"](even) == pytest.approx(1.0)
  assert even["kv_usage_fullest"] == even["kv_usage_mean"] == pytest.approx(0.5)
  # One pool does all the work: N (here 2), whatever its level.
  assert fleet_study.FIGURES["pool_imbalance"](pools([(0.0, 0.3)], [])) == pytest.approx(2.0)
  # Each pool's use is held from one of its steps to the next, 0 before its first: the
  # second pool holds 0.5 from t = 5 of 10, so the mean pool is 3/4 as full as the fullest.
  late = pools([(0.0, 0.5)], [(5.0, 0.5)])
  assert late["kv_usage_fullest"] == pytest.approx(0.5)
  assert late["kv_usage_mean"] == pytest.approx(0.375, abs=0.01)
  # A ratio of averages: a moment with one busy pool among idle ones weighs as little as
  # the pages it holds (averaging max/mean per instant would read 2 there).
  blip = pools([(0.0, 0.01), (1.0, 0.5)], [(1.0, 0.5)])
  assert fleet_study.FIGURES["pool_imbalance"](blip) == pytest.approx(1.0, abs=0.002)
  assert fleet_study.FIGURES["pool_imbalance"](pools([(0.0, 0.0)], [])) is None
  assert fleet_study.FIGURES["pool_peak_imbalance"](pools([(0.0, 0.9)], [(0.0, 0.3)])) == \
      pytest.approx(1.5)


def entry(goodput=0.5, imbalance=1.5, hits=0.2, room=0.0, retries=0.0):
  return dict(goodput_fraction=goodput, pool_imbalance=imbalance, prefix_hit_rate=hits,
              refused_while_room=room, door_retries=retries, num_requests=100)


def table(**by_policy) -> dict:
  """One cell's table: the policies given (as dicts of `entry`'s arguments) and the
  others at `entry`'s defaults."""
  policies = {p: entry(**by_policy.get(p, {})) for p in fleet_study.POLICIES}
  return {"traffic": {"8": {"5x": policies}}}


def verdict(claim, **by_policy) -> str:
  return claim(table(**by_policy), "traffic", "8", "5x")["verdict"]


def test_the_most_goodput_claim_holds_fails_and_is_undecided():
  def most(**by_policy):
    return verdict(lambda *args: fleet_study.claim_most_goodput(*args, "kv_headroom"),
                   **by_policy)

  assert most(kv_headroom=dict(goodput=0.8)) == "holds"
  assert most(kv_headroom=dict(goodput=0.49)) == "holds"  # within 5% of 0.5: a tie
  assert most(kv_headroom=dict(goodput=0.4)) == "fails"
  zeros = {p: dict(goodput=0.0) for p in fleet_study.POLICIES}
  assert most(**zeros).startswith("undecided: ")


def test_the_most_even_claim_holds_fails_and_is_undecided():
  even = fleet_study.claim_most_even
  assert verdict(even, kv_headroom=dict(imbalance=1.2)) == "holds"
  assert verdict(even, kv_headroom=dict(imbalance=1.52)) == "holds"  # 0.52 vs 0.5: a tie
  assert verdict(even, round_robin=dict(imbalance=1.1)) == "fails"
  empty = {p: dict(imbalance=None) for p in fleet_study.POLICIES}
  assert verdict(even, **empty).startswith("undecided: ")


def test_the_prefix_hits_claim_holds_fails_and_is_undecided():
  hits = fleet_study.claim_most_prefix_hits
  assert verdict(hits, prefix_affinity=dict(hits=0.6)) == "holds"
  assert verdict(hits, round_robin=dict(hits=0.6)) == "fails"
  none = {p: dict(hits=0.0) for p in fleet_study.POLICIES}
  assert verdict(hits, **none).startswith("undecided: ")


def test_the_refused_while_room_claim_holds_fails_and_is_undecided():
  room = fleet_study.claim_refused_while_room
  assert verdict(room, least_requests=dict(room=3.0)) == "holds"
  assert verdict(room, least_requests=dict(room=10.0), kv_headroom=dict(room=10.2)) == "fails"
  assert verdict(room, least_requests=dict(room=0.5)) == "fails"  # less than one request
  assert verdict(room) == ("undecided: neither had a replica refuse a request another "
                           "could take")


def test_the_sustained_claim_reads_the_best_policy_at_1x():
  made = {"traffic": {"8": {"1x": {p: entry() for p in fleet_study.POLICIES}}}}
  measured = {"traffic": {"replica_sustainable_requests_per_s": 1.5}}
  claim = fleet_study.claim_sustains(made, measured, "traffic", "8")
  assert claim["verdict"] == "fails" and claim["premises"]["rate_requests_per_s"] == 12.0
  made["traffic"]["8"]["1x"]["round_robin"]["goodput_fraction"] = 0.95
  assert fleet_study.claim_sustains(made, measured, "traffic", "8")["verdict"] == "holds"
  del made["traffic"]["8"]["1x"]
  assert fleet_study.claim_sustains(made, measured, "traffic", "8")["verdict"].startswith(
      "undecided: ")


def test_a_small_run_writes_its_figures_and_premises_and_resumes(tmp_path):
  scale = dataclasses.replace(fleet_study.SCALES["smoke"], fleets=((3, 6),))
  record = fleet_study.run(scale, tmp_path, show_progress=False)
  results = tmp_path / "fleet" / "results.jsonl"
  lines = results.read_text().splitlines()
  assert len(lines) == len(scale.traffics) * len(scale.loads) * len(scale.policies)
  again = fleet_study.run(scale, tmp_path, show_progress=False)  # resumed: nothing reruns
  assert results.read_text().splitlines() == lines
  assert again["table"] == record["table"] and again["measured"] == record["measured"]

  written = fleet_study.write(record, tmp_path)
  assert all((tmp_path / name).stat().st_size for name in written)
  study = json.loads((tmp_path / "study.json").read_text())
  assert "rows" not in study and study["premises"]["model"]["name"]
  assert study["premises"]["policies"]["watermark"] == 0.4  # the replicas' shipped line
  for traffic, measured in study["measured"].items():
    # The SLOs by the line study's rule, from one replica's unloaded run.
    assert measured["slo_ttft_s"] == pytest.approx(3 * measured["unloaded_ttft_p99_s"],
                                                   abs=1e-4)
    assert measured["slo_tpot_s"] == pytest.approx(3 * measured["unloaded_tpot_p50_s"],
                                                   abs=1e-4)
    for load, by_policy in study["table"][traffic]["3"].items():
      assert set(by_policy) == set(fleet_study.POLICIES), load
      for figures in by_policy.values():
        assert figures["num_requests"] == 18 and 0 <= figures["goodput_fraction"] <= 1
        assert figures["refused_while_room"] <= figures["door_retries"]
  # Every run is serve_bench's fleet (3 replicas, each policy), judged by its traffic's
  # SLOs, at N x one replica's sustainable rate.
  for row in record["rows"]:
    cell = row["cell"]
    traffic, replicas, load, policy = fleet_study.where(cell, record["measured"])
    measured = record["measured"][traffic]
    assert row["premises"]["fleet"]["replicas"] == 3 and replicas == "3"
    assert row["premises"]["fleet"]["router"] == policy
    assert cell["slo_ttft"] == measured["slo_ttft_s"]
    assert float(cell["arrival_rate"]) == pytest.approx(
        float(load.rstrip("x")) * 3 * measured["replica_sustainable_requests_per_s"], rel=1e-3)
  assert study["claims"]
  for claim in study["claims"]:
    assert claim["verdict"] in ("holds", "fails") or claim["verdict"].startswith("undecided: ")
  goodput, pools = fleet_study.figures(record)
  for figure in (goodput, pools):
    for axes in figure.axes:
      assert axes.get_ylabel() and axes.get_xlabel()
  assert "SLO" in " ".join(text.get_text() for axes in goodput.axes for text in axes.texts)
  report = fleet_study.format_report(record)
  assert all(claim["claim"] in report for claim in record["claims"])


def test_a_claim_is_undecided_where_a_seed_decides_it_the_other_way():
  means = table(least_requests=dict(goodput=0.6), kv_headroom=dict(goodput=0.59))
  seeds = {"0": table(least_requests=dict(goodput=0.5), kv_headroom=dict(goodput=0.6)),
           "1": table(least_requests=dict(goodput=0.7), kv_headroom=dict(goodput=0.58))}
  claim = fleet_study.agreed(fleet_study.claim_most_goodput, means, seeds, "traffic", "8",
                             "5x", "kv_headroom")
  assert claim["verdict"] == ("undecided: the seeds disagree (seed 0 holds, seed 1 fails); "
                              "the means hold")
  seeds["1"] = table(least_requests=dict(goodput=0.6), kv_headroom=dict(goodput=0.6))
  claim = fleet_study.agreed(fleet_study.claim_most_goodput, means, seeds, "traffic", "8",
                             "5x", "kv_headroom")
  assert claim["verdict"] == "holds"
  # A seed that cannot decide does not overrule the means.
  seeds["1"] = table(**{p: dict(goodput=0.0) for p in fleet_study.POLICIES})
  assert fleet_study.agreed(fleet_study.claim_most_goodput, means, seeds, "traffic", "8",
                            "5x", "kv_headroom")["verdict"] == "holds"
