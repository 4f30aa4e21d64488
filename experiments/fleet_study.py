r"""The fleet study: many replicas behind one door, which routing policy wins where?

  python -m experiments.fleet_study --sweep_workers=2       # 8 and 64 replicas: ~25 min
  python -m experiments.fleet_study --scale=smoke           # seconds, for CI
  python -m experiments.fleet_study --sim_setup=yi_34b_a100_pcie_tp2 \
      --workdir=workdir/fleet_study_yi34b                    # calibrated Yi-34B TP 2

A fleet of simulated replicas serves the same traffic under each routing policy of
`kvpage.host.routing` (`round_robin`, `least_requests`, `kv_headroom`,
`prefix_affinity`), at 8 and 64 replicas and 1x, 2x, 5x and 10x the fleet's sustainable
rate. Each run is a sweep cell (`experiments.sweep`) of `serve_bench --replicas=N
--router=POLICY` (`kvpage.sim.fleet`: each replica the engine of
`experiments.sim_setups`' deployment, with its own pool and clock, its steps priced
before the first request as a server's are; the door asks the replicas in the router's
order until one admits; the router's snapshots refreshed every `fleet.REFRESH_S` of
simulated time, prefix_affinity's margins the fleet's defaults), so a cell's figures are
that command's. Each replica holds the lines the server ships (`cli.hold_serving_line`:
the KV watermark of `server.watermark` and the forecast-TTFT line of
`server.ttft_line_s`), as `python -m experiments.serve --replicas=N` would. A request
every replica refused is lost: clients do not retry here.

Traffic (Poisson arrivals; clients ask for `max_tokens` 1,024 and use 32-512, the line
study's `OUTPUT`; the model's context raised to 16,384 tokens, the line study's
`CONTEXT`):

  * `long/short`: one prompt in ten is 8,000 tokens, the rest 50 (`mix:0.1:8000:50`);
  * `shared prompts`: many users sharing a few long system prompts: each prompt is one
    of 4 system prompts of 2,048 tokens followed by the user's own turn (lognormal,
    median 128 tokens); replicas cache prefixes (`cache.prefix_caching`).

The thresholds are premises chosen by the line study's rules, measured on one replica
of the same deployment with no line (runs of `--scale`'s `measure_requests` requests,
sweep cells kept in `measure/`): per traffic, its throughput with everything offered
at once; from an unloaded run at `line_study.UNLOADED` x that throughput, the TTFT SLO
(`line_study.SLO_FACTOR` x its TTFT p99) and the TPOT SLO (the same factor x its median
TPOT); and one replica's sustainable rate, the highest Poisson rate at which
`line_study.ATTAINMENT` of its requests meet both SLOs (search: grow until it breaks,
then bisect). The fleet's sustainable rate is derived, not searched: N x one replica's,
the rate N replicas sustain if the router spread the load perfectly (a search over
64-replica runs does not fit this machine). A policy that spreads it worse falls short
of it already at 1x: the claim at 1x says whether each does.

Each run offers N x a number of requests per replica set by the scale (`Scale.fleets`):
150 at 8 replicas, 40 at 64, where every arrival the fleet refuses is asked of all 64
replicas and a run costs about 64 times an 8-replica run's work per request. So a run
holds fewer seconds of arrivals at 64 replicas (at 10x the long/short mix's rate, 2.3 s
against 8.6 s: a burst more than a sustained overload; `arrival_window_s` in
`study.json`), and the two fleet sizes are compared each on its own, not with each
other. Reported per cell (traffic, replicas, load, policy; means over seeds), each read
from the fleet's summary (`kvpage.sim.fleet.summarize`, where each is defined):

  * goodput: the share of offered requests finished within both SLOs (DistServe's SLO
    attainment; a rejected request counts against it; per second it would credit a
    policy with the shorter drain its rejections leave), and per second too;
  * TTFT p99 of the served, and their TPOT p99;
  * rejections: requests every replica refused, by the fleet's status (429/503/400);
  * how unevenly the pools fill (`pool_imbalance`): the fullest pool's KV use averaged
    over instants spread evenly over the run, over the mean pool's averaged over the
    same instants (each replica's use held from one of its steps to the next; 1: even;
    N: one replica does all the work). A ratio of averages, so nearly idle moments,
    where one busy pool among idle ones reads as N, weigh as little as the pages they
    hold. Beside it the peak over the mean of the replicas' peak KV use, as
    `benchmarks.fleet_sim` reports it;
  * the prefix cache's hit rate: prompt tokens found cached, over those looked up, all
    replicas together;
  * `refused_while_room`: arrivals a replica refused while another replica had room for
    them at that very moment: the door went on and another replica admitted them (the
    door asks every replica at the same instant of simulated time, and a refusal
    changes nothing, so the one that admitted had that room when the first refused).
    Without the door's retries (a router that asks one replica) each would have been
    pushed back. Beside it the door's retries (replicas asked after a refusal, for the
    served), and `refused_with_kv_room`: requests every replica refused while at least
    one of them had KV room for them (refused by a line checked after the KV line,
    `routing.AFTER_KV_LINE`: its forecast wait, or its queue), so that memory was not
    what refused them. (Every replica is asked, so a request the fleet refused had no room
    under any replica's lines: that count is 0 by construction and is not reported.)

`claims` states, each decided from the table of means with `TIE` as the margin or
`undecided: why`: which policy serves the most goodput per traffic at each overload
(kv_headroom on the long/short mix, prefix_affinity on shared prompts), which fills the
pools most evenly, which finds the most cached prefix, whether least_requests refuses
while another replica had room more often than kv_headroom, and whether the fleet keeps
`line_study.ATTAINMENT` within the SLOs at 1x. A seed draws the same trace for every
policy, so each seed's own table is a paired comparison: a claim holds or fails only
where no seed's table decides it the other way (else it is undecided: the seeds spread
wider than the margin); the figures draw each mean with the seeds' min-max. Everything
goes to `--workdir`, resumably: the measurement's sweep cells (`measure/`), the fleet
runs' (`fleet/`), `study.json`, and the figures `goodput_by_load.png` and
`pools_by_policy.png`.
"""

import concurrent.futures
import dataclasses
import json
import multiprocessing
import pathlib
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_collections
import numpy as np
from absl import flags

from experiments import claims as claims_lib
from experiments import cli, line_study, serve_bench, sim_setups, sweep
from experiments.sim_setups import SimSetup
from kvpage.host import routing
from kvpage.sim import fleet as fleet_lib

flags.FLAGS.set_default("workdir", "workdir/fleet_study")

TRAFFICS = {"long/short": dict(prompt_len="mix:0.1:8000:50", shared_prefix=""),
            "shared prompts": dict(prompt_len="lognormal:128:2048", shared_prefix="2048:4")}
POLICIES = routing.POLICIES
OUTPUT = line_study.OUTPUT  # clients ask for 1,024 tokens and use 32-512
CONTEXT = line_study.CONTEXT
# The policy each claim expects to serve the most, per traffic.
EXPECTED_WINNER = {"long/short": "kv_headroom", "shared prompts": "prefix_affinity"}
TIE = 0.05  # figures within this share of each other are not told apart by a claim
# A run's figures, each read from its fleet summary (`kvpage.sim.fleet.summarize`) and
# averaged over seeds in the table.
FIGURES: dict[str, Callable[[dict[str, Any]], Any]] = {
    "goodput_fraction": lambda s: s["goodput_fraction"],
    "goodput_requests_per_s": lambda s: s["goodput_requests_per_s"],
    "ttft_p50_s": lambda s: s["ttft_s"]["p50"],
    "ttft_p99_s": lambda s: s["ttft_s"]["p99"],
    "tpot_p99_s": lambda s: s["tpot_s"]["p99"],
    "num_requests": lambda s: s["num_requests"],
    "num_finished": lambda s: s["num_finished"],
    "num_rejected": lambda s: s["num_rejected"],
    **{f"rejected_{status}": (lambda s, status=status: s["rejections"].get(status, 0))
       for status in ("400", "429", "503")},
    "rejected_fraction": lambda s: s["num_rejected"] / max(1, s["num_requests"]),
    "refused_while_room": lambda s: s["refused_while_room"],
    "refused_while_room_fraction": lambda s: s["refused_while_room"] / max(1, s["num_requests"]),
    "door_retries": lambda s: s["door_retries"],
    "refused_with_kv_room": lambda s: s["refused_with_kv_room"],
    "pool_imbalance": lambda s: s["pool_imbalance_over_time"],
    "pool_peak_imbalance": lambda s: s["pool_peak_imbalance"],
    "kv_usage_mean": lambda s: s["kv_usage_mean"],
    "kv_usage_fullest": lambda s: s["kv_usage_fullest"],
    "prefix_hit_rate": lambda s: s["prefix_hit_rate"],
    "num_preemptions": lambda s: s["num_preemptions"],
    "duration_s": lambda s: s["duration_s"],
}


@dataclasses.dataclass(frozen=True)
class Scale:
  """The study's size; `SCALES` holds the two the CLI offers."""

  fleets: tuple[tuple[int, int], ...]  # (replicas, requests per replica in each run)
  seeds: int
  traffics: tuple[str, ...]
  loads: tuple[float, ...]  # x the fleet's sustainable rate
  policies: tuple[str, ...]
  measure_requests: int  # requests per run of the one-replica measurement
  tolerance: float  # the capacity search's bracket, relative


SCALES = {
    # At 10x the long/short mix's rate: 8.6 s of arrivals at 8 replicas, 2.3 s (a burst)
    # at 64, where every refused arrival asks all 64 replicas (what this machine affords).
    "full": Scale(fleets=((8, 150), (64, 40)), seeds=2, traffics=tuple(TRAFFICS),
                  loads=(1, 2, 5, 10), policies=POLICIES, measure_requests=600,
                  tolerance=0.05),
    "smoke": Scale(fleets=((4, 8),), seeds=1, traffics=tuple(TRAFFICS), loads=(1, 5),
                   policies=POLICIES, measure_requests=40, tolerance=0.3),
}


def replica_config(setup: SimSetup) -> tuple[ml_collections.ConfigDict, str]:
  """A replica's config: the setup's, simulated, the context raised, the study's output
  lengths, holding the server's lines; and which lines those are, in words."""
  config = setup.get_config()
  if setup.hardware is not None:
    config.hardware = setup.hardware
  config.model.max_seq_len = max(config.model.max_seq_len, CONTEXT)
  config.bench.update(dict(executor="sim", arrival_process="poisson", **OUTPUT))
  lines = cli.hold_serving_line(config)
  return config, lines


def _probe(config: ml_collections.ConfigDict, values: dict[str, Any],
           directory: pathlib.Path, show_progress: bool) -> dict[str, Any]:
  """One measurement run on one replica with no line: a sweep cell in `directory`."""
  (cell,) = sweep.plan_cells(config, [{**line_study.LINE_KEYS, **values}], [0])
  (row,) = sweep.run_cells([cell], directory, show_progress=show_progress)
  return row["summary"]


def measure(scale: Scale, setup: SimSetup, directory: pathlib.Path,
            show_progress: bool = False) -> dict[str, Any]:
  """Per traffic, on one replica with no line (the line study's rules, `line_study`):
  the throughput with everything offered at once; the SLOs, from an unloaded run; the
  sustainable rate, found by search; and the premises of the unloaded run."""
  base = line_study.base(line_study.Scale(
      num_requests=scale.measure_requests, seeds=1, mixes=(), arrivals=(), loads=(), knobs=1,
      extend=False, tolerance=scale.tolerance), setup)
  sweep.claim_workdir(directory, base, [])  # the probes' base: a resumed study must share it
  measured: dict[str, Any] = {}
  for traffic in scale.traffics:
    probe = lambda **values: _probe(base, {**TRAFFICS[traffic], **values},  # noqa: B023
                                    directory, show_progress)
    saturated = probe(arrival_rate="inf")
    throughput = saturated["num_finished"] / saturated["duration_s"]
    unloaded = probe(arrival_process="poisson",
                     arrival_rate=f"{line_study.UNLOADED * throughput:.4g}",
                     num_requests=max(40, scale.measure_requests // 5))
    slos = dict(slo_ttft=round(line_study.SLO_FACTOR * unloaded["ttft_s"]["p99"], 4),
                slo_tpot=round(line_study.SLO_FACTOR * unloaded["tpot_s"]["p50"], 4))

    def meets(rate: float) -> bool:
      summary = probe(arrival_process="poisson", arrival_rate=f"{rate:.4g}", **slos)  # noqa: B023
      return summary["goodput_fraction"] >= line_study.ATTAINMENT

    found = claims_lib.search_capacity(
        meets, throughput, max_rate=line_study.SEARCH_REACH * throughput,
        min_rate=line_study.UNLOADED * throughput, relative_tolerance=scale.tolerance)
    measured[traffic] = dict(
        throughput_at_once=throughput, unloaded_rate=line_study.UNLOADED * throughput,
        unloaded_ttft_p99_s=unloaded["ttft_s"]["p99"],
        unloaded_tpot_p50_s=unloaded["tpot_s"]["p50"],
        slo_ttft_s=slos["slo_ttft"], slo_tpot_s=slos["slo_tpot"],
        replica_sustainable_requests_per_s=found.rate or line_study.UNLOADED * throughput,
        capacity_search=found.to_dict(),
        pool_pages=saturated["pages_total"],
        premises=json.loads(json.dumps(unloaded["premises"])))  # as a resumed run reads it
  return measured


def grid(scale: Scale, config: ml_collections.ConfigDict, measured: dict[str, Any],
         done: frozenset[str] | set[str] = frozenset()) -> list[sweep.Cell]:
  """The fleet runs of `scale` as sweep cells (serve_bench settings over `config`: the
  traffic, the rate and the SLOs measured, `replicas` and `router`), every policy and
  seed; the costliest first (the most replicas and requests, then the highest load), so
  that the workers end together."""
  groups = []
  for traffic in scale.traffics:
    m = measured[traffic]
    for replicas, per_replica in scale.fleets:
      for load in scale.loads:
        rate = load * replicas * m["replica_sustainable_requests_per_s"]
        values = [dict(TRAFFICS[traffic], arrival_rate=f"{rate:.4g}",
                       num_requests=per_replica * replicas, slo_ttft=m["slo_ttft_s"],
                       slo_tpot=m["slo_tpot_s"], replicas=replicas, router=policy)
                  for policy in scale.policies]
        groups.append(((replicas * per_replica, load),
                       sweep.plan_cells(config, values, range(scale.seeds), done)))
  return [cell for _, cells in sorted(groups, key=lambda group: group[0], reverse=True)
          for cell in cells]


def _run_cell(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """One fleet run (in a worker process when there are several): its summary."""
  summary, _ = serve_bench.run_bench(config, show_progress=False)
  return summary


def run_fleet(config: ml_collections.ConfigDict, cells: Sequence[sweep.Cell],
              directory: pathlib.Path, show_progress: bool = True,
              label: Callable[[sweep.Cell], str] = sweep.Cell.describe
              ) -> list[dict[str, Any]]:
  """The fleet runs `cells` into `directory` as a sweep keeps its runs (`sweep.json`,
  a row per run appended to `results.jsonl` as it ends: resumable), `--sweep_workers` at
  a time, a line on stderr as each ends (its cell named by `label`); returns every
  cell's row (its cell, the fleet's summary, its premises), in the order of `cells`.
  (`sweep.run_cells` would do, but its flat metrics read figures a fleet's summary
  lacks.)"""
  sweep.claim_workdir(directory, config, cells)
  done = {row["cell_id"]: row for row in sweep.read_rows(directory)}
  todo = [cell for cell in cells if cell.cell_id not in done]
  start = time.perf_counter()

  def ended(number: int, cell: sweep.Cell, summary: dict[str, Any]) -> None:
    row = dict(cell_id=cell.cell_id, cell=cell.values, summary=summary,
               premises=summary["premises"])
    cli.append_line(directory / sweep.RESULTS, json.dumps(row))  # whole, or not at all
    done[cell.cell_id] = row
    if show_progress:
      print(f"fleet run {number + 1}/{len(todo)} ({time.perf_counter() - start:.0f} s): "
            f"{label(cell)}: goodput {summary['goodput_fraction']:.0%}, refused "
            f"{summary['num_rejected']}, refused while another had room "
            f"{summary['refused_while_room']}", file=sys.stderr, flush=True)

  workers = sweep.workers()
  if workers == 1 or len(todo) < 2:
    for number, cell in enumerate(todo):
      ended(number, cell, _run_cell(cell.config))
  else:
    context = multiprocessing.get_context("spawn")  # no forked state in the workers
    with concurrent.futures.ProcessPoolExecutor(min(workers, len(todo)),
                                                mp_context=context) as pool:
      sweep.run_in_pool(pool, todo, _run_cell, ended)
  return [done[cell.cell_id] for cell in cells]


def where(cell: Mapping[str, Any], measured: dict[str, Any]) -> tuple[str, str, str, str]:
  """A fleet run's (traffic, replicas, load, policy), read back from its cell."""
  traffic = next(name for name, spec in TRAFFICS.items()
                 if all(cell[key] == value for key, value in spec.items()))
  one = measured[traffic]["replica_sustainable_requests_per_s"]
  load = round(float(cell["arrival_rate"]) / (cell["replicas"] * one), 2)
  return traffic, str(cell["replicas"]), f"{load:g}x", cell["router"]


def analyze(rows: Sequence[dict[str, Any]], measured: dict[str, Any]) -> dict[str, Any]:
  """table[traffic][replicas][load][policy]: each figure's mean over seeds, and each
  seed's goodput; in the order of `TRAFFICS`, fleet size, load and `POLICIES`."""
  groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
  for row in rows:
    groups.setdefault(where(row["cell"], measured), []).append(row)
  order = lambda key: (list(TRAFFICS).index(key[0]), int(key[1]), float(key[2].rstrip("x")),
                       POLICIES.index(key[3]))
  table: dict[str, Any] = {}
  for (traffic, replicas, load, policy), group in sorted(groups.items(),
                                                         key=lambda item: order(item[0])):
    means: dict[str, Any] = {}
    for name, read in FIGURES.items():
      values = [read(row["summary"]) for row in group]
      values = [value for value in values if value is not None]
      means[name] = float(np.mean(values)) if values else None
    means["goodput_by_seed"] = [row["summary"]["goodput_fraction"] for row in group]
    means["seeds"] = len(group)
    table.setdefault(traffic, {}).setdefault(replicas, {}).setdefault(load, {})[policy] = means
  return table


def seed_tables(rows: Sequence[dict[str, Any]], measured: dict[str, Any]) -> dict[str, Any]:
  """Each seed's own table (`analyze` of its rows alone), by seed. A seed draws the same
  trace for every policy, so each seed's table compares the policies on one trace."""
  seeds = sorted({row["cell"]["seed"] for row in rows})
  return {str(seed): analyze([row for row in rows if row["cell"]["seed"] == seed], measured)
          for seed in seeds}


# The claims: each a function of a table that holds, fails, or says why it cannot decide
# (`experiments.claims`), with its margin and the load beside it; stated on the table of
# means, and holding or failing only where every seed's own table agrees (`agreed`).

def _where(traffic: str, replicas: str, load: str) -> str:
  return f"{traffic}, {replicas} replicas, {load}"


def _ranked(by_policy: Mapping[str, Any], metric: str, reverse: bool = True) -> list[str]:
  present = [p for p in by_policy if by_policy[p].get(metric) is not None]
  return sorted(present, key=lambda p: by_policy[p][metric], reverse=reverse)


def claim_most_goodput(table: dict[str, Any], traffic: str, replicas: str, load: str,
                       policy: str) -> dict[str, Any]:
  """`policy` serves the largest share of requests within both SLOs: no policy serves
  more than `TIE` more than it."""
  by_policy = table[traffic][replicas][load]
  good = {p: entry["goodput_fraction"] for p, entry in by_policy.items()}
  ranked = _ranked(by_policy, "goodput_fraction")
  top = good[ranked[0]] if ranked else 0.0
  ours = good.get(policy)
  holds = None if ours is None or top == 0 else ours >= (1 - TIE) * top
  why = f"{policy} was not run" if ours is None else "no policy serves anything within the SLOs"
  return claims_lib.claim(
      f"{_where(traffic, replicas, load)}: {policy} serves the most goodput (within {TIE:.0%} "
      "of the best policy)", holds,
      ", ".join(f"{p} {good[p]:.1%}" for p in ranked) + " of offered requests within both SLOs",
      why=why, premises=dict(tie=TIE, load=load))


def claim_most_even(table: dict[str, Any], traffic: str, replicas: str, load: str,
                    policy: str = "kv_headroom") -> dict[str, Any]:
  """`policy` fills the pools most evenly: its time-averaged max/mean KV use is the
  lowest, within `TIE` of the lowest's distance from even (1)."""
  by_policy = table[traffic][replicas][load]
  ratio = {p: entry["pool_imbalance"] for p, entry in by_policy.items()}
  ranked = _ranked(by_policy, "pool_imbalance", reverse=False)
  ours = ratio.get(policy)
  holds = (None if ours is None or not ranked else
           ours - 1 <= (1 + TIE) * (ratio[ranked[0]] - 1) + 1e-9)
  why = f"{policy} was not run" if policy not in by_policy else "no pool held a page"
  return claims_lib.claim(
      f"{_where(traffic, replicas, load)}: {policy} fills the pools most evenly (the lowest "
      f"max/mean KV use over time, its excess over 1 within {TIE:.0%} of the lowest's)", holds,
      ", ".join(f"{p} {ratio[p]:.2f}" for p in ranked) + " (max/mean, time-averaged)",
      why=why, premises=dict(tie=TIE, load=load))


def claim_most_prefix_hits(table: dict[str, Any], traffic: str, replicas: str, load: str,
                           policy: str = "prefix_affinity") -> dict[str, Any]:
  """`policy` finds the most prompt tokens in the prefix cache: no policy's hit rate is
  more than `TIE` higher."""
  by_policy = table[traffic][replicas][load]
  rate = {p: entry["prefix_hit_rate"] for p, entry in by_policy.items()}
  ranked = _ranked(by_policy, "prefix_hit_rate")
  top = rate[ranked[0]] if ranked else None
  ours = rate.get(policy)
  holds = None if ours is None or not top else ours >= (1 - TIE) * top
  why = (f"{policy} was not run or looked nothing up" if ours is None
         else "no policy found any prompt token cached")
  return claims_lib.claim(
      f"{_where(traffic, replicas, load)}: {policy} has the highest prefix-cache hit rate "
      f"(within {TIE:.0%} of the best)", holds,
      ", ".join(f"{p} {rate[p]:.1%}" for p in ranked) + " of prompt tokens looked up",
      why=why, premises=dict(tie=TIE, load=load))


def claim_refused_while_room(table: dict[str, Any], traffic: str, replicas: str, load: str,
                             worse: str = "least_requests",
                             better: str = "kv_headroom") -> dict[str, Any]:
  """`worse` has a replica refuse requests while another had room for them more often
  than `better`: by more than `TIE`, and by at least one request (means over seeds)."""
  by_policy = table[traffic][replicas][load]
  if worse not in by_policy or better not in by_policy:
    counts = None
  else:
    counts = (by_policy[worse]["refused_while_room"], by_policy[better]["refused_while_room"])
  if counts is None:
    holds, why = None, f"{worse} or {better} was not run"
  elif counts == (0, 0):
    holds, why = None, "neither had a replica refuse a request another could take"
  else:
    holds, why = counts[0] > (1 + TIE) * counts[1] and counts[0] - counts[1] >= 1, ""
  offered = by_policy.get(worse, {}).get("num_requests") or 0
  evidence = ("not run" if counts is None else
              f"{worse} {counts[0]:g}, {better} {counts[1]:g} of {offered:g} arrivals "
              "refused by a replica while another admitted them (door retries: "
              + ", ".join(f"{p} {by_policy[p]['door_retries']:g}" for p in by_policy) + ")")
  return claims_lib.claim(
      f"{_where(traffic, replicas, load)}: under {worse} a replica refuses requests while "
      f"another had room more often than under {better} (by more than {TIE:.0%})", holds,
      evidence, why=why, premises=dict(tie=TIE, load=load))


def claim_sustains(table: dict[str, Any], measured: dict[str, Any], traffic: str,
                   replicas: str, load: str = "1x") -> dict[str, Any]:
  """At 1x (N x one replica's sustainable rate), the best policy keeps
  `line_study.ATTAINMENT` of requests within both SLOs: the derived rate is one the
  fleet sustains."""
  by_policy = table[traffic][replicas].get(load)
  ranked = _ranked(by_policy or {}, "goodput_fraction")
  holds = None if not ranked else (
      by_policy[ranked[0]]["goodput_fraction"] >= line_study.ATTAINMENT)  # type: ignore[index]
  rate = int(replicas) * measured[traffic]["replica_sustainable_requests_per_s"]
  return claims_lib.claim(
      f"{_where(traffic, replicas, load)}: at {replicas} x one replica's sustainable rate "
      f"({rate:.3g} req/s) the best policy keeps {line_study.ATTAINMENT:.0%} of requests "
      "within both SLOs", holds,
      "not run" if not ranked else ", ".join(
          f"{p} {by_policy[p]['goodput_fraction']:.1%}" for p in ranked),  # type: ignore[index]
      why=f"{load} was not run", premises=dict(attainment=line_study.ATTAINMENT,
                                               rate_requests_per_s=rate))


def agreed(claim: Callable[..., dict[str, Any]], table: dict[str, Any],
           by_seed: Mapping[str, dict[str, Any]], *args: Any) -> dict[str, Any]:
  """`claim(table, *args)` on the table of means, undecided where a seed's own table
  decides it the other way (the seeds' spread is wider than the margin); a seed that
  cannot decide does not overrule."""
  stated = claim(table, *args)
  verdicts = {seed: claim(seed_table, *args)["verdict"] for seed, seed_table in by_seed.items()}
  decided = {seed: v for seed, v in verdicts.items() if v in ("holds", "fails")}
  if stated["holds"] is not None and any(v != stated["verdict"] for v in decided.values()):
    seeds = ", ".join(f"seed {seed} {v.split(':')[0]}" for seed, v in verdicts.items())
    return claims_lib.claim(stated["claim"], None, stated["evidence"],
                            why=f"the seeds disagree ({seeds}); the means "
                                f"{stated['verdict'].removesuffix('s')}",
                            premises=stated["premises"])
  return stated


def claims_of(table: dict[str, Any], measured: dict[str, Any],
              by_seed: Mapping[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
  """Every claim of the study on `table`, each checked against each seed's table in
  `by_seed` (`agreed`)."""
  by_seed = by_seed or {}
  stated = []
  for traffic, by_replicas in table.items():
    for replicas, by_load in by_replicas.items():
      if "1x" in by_load:
        stated.append(agreed(lambda t, *a: claim_sustains(t, measured, *a), table, by_seed,
                             traffic, replicas))
      for load in sorted(by_load, key=lambda load: float(load.rstrip("x"))):
        where = (traffic, replicas, load)
        if traffic == "shared prompts":
          stated.append(agreed(claim_most_prefix_hits, table, by_seed, *where))
        if float(load.rstrip("x")) < 2:
          continue  # the rest are about overload
        if traffic in EXPECTED_WINNER:
          stated.append(agreed(claim_most_goodput, table, by_seed, *where,
                               EXPECTED_WINNER[traffic]))
        stated.append(agreed(claim_most_even, table, by_seed, *where))
        stated.append(agreed(claim_refused_while_room, table, by_seed, *where))
  return stated


def winners(table: dict[str, Any]) -> dict[str, Any]:
  """Per traffic, replicas and load: the policies that tie for the most goodput, the
  most even pools and the most prefix hits (within `TIE` of the best, as the claims
  judge; the best first)."""
  out: dict[str, Any] = {}
  for traffic, by_replicas in table.items():
    for replicas, by_load in by_replicas.items():
      for load, by_policy in by_load.items():
        picks = {}
        for metric, reverse in (("goodput_fraction", True), ("pool_imbalance", False),
                                ("prefix_hit_rate", True)):
          ranked = _ranked(by_policy, metric, reverse)
          best = by_policy[ranked[0]][metric] if ranked else None
          if not best:  # nothing to rank (no pool held a page, no prompt was cached)
            picks[metric] = []
          elif reverse:
            picks[metric] = [p for p in ranked if by_policy[p][metric] >= (1 - TIE) * best]
          else:
            picks[metric] = [p for p in ranked
                             if by_policy[p][metric] - 1 <= (1 + TIE) * (best - 1) + 1e-9]
        out.setdefault(traffic, {}).setdefault(replicas, {})[load] = picks
  return out


def run(scale: Scale, directory: pathlib.Path, *, show_progress: bool = True,
        setup: SimSetup = sim_setups.SETUPS[sim_setups.DEFAULT]) -> dict[str, Any]:
  """The study into `directory` (resumable) on `setup`; the record for study.json."""
  measured = measure(scale, setup, directory / "measure", show_progress)
  config, lines = replica_config(setup)
  runs = directory / "fleet"
  cells = grid(scale, config, measured, sweep.done_ids(runs))
  label = lambda cell: (f"{_where(*where(cell.values, measured)[:3])}, "
                       f"{cell.values['router']}, seed {cell.values['seed']}")
  rows = run_fleet(config, cells, runs, show_progress, label)
  table, by_seed = analyze(rows, measured), seed_tables(rows, measured)
  # A fleet run's premises (model, dtype, device, pool, the replicas' scheduler, the
  # router's refresh and margins, versions), less what differs from run to run.
  premises = {key: value for key, value in rows[0]["premises"].items()
              if key not in ("workload", "seed")}
  premises["fleet"] = {key: value for key, value in premises["fleet"].items()
                       if key not in ("replicas", "router")}
  fleet = premises["fleet"]
  window = {traffic: {str(replicas): {
      f"{load:g}x": per_replica / (load * measured[traffic]["replica_sustainable_requests_per_s"])
      for load in scale.loads} for replicas, per_replica in scale.fleets}
      for traffic in scale.traffics}
  return dict(
      scale=dataclasses.asdict(scale), setup=setup.name, context=CONTEXT,
      traffics={name: TRAFFICS[name] for name in scale.traffics}, output=OUTPUT,
      rules=dict(
          slo=f"each traffic's SLOs: {line_study.SLO_FACTOR:g}x the TTFT p99 and median TPOT "
              f"of one replica's unloaded run ({line_study.UNLOADED:g}x its throughput with "
              "everything offered at once, no line)",
          sustainable=f"the fleet's: N x one replica's sustainable rate (the highest Poisson "
                      f"rate at which {line_study.ATTAINMENT:.0%} of its requests meet both "
                      "SLOs with no line; search to "
                      f"{scale.tolerance:.0%}), the rate N replicas sustain if perfectly "
                      "balanced",
          replicas=f"each replica holds the server's lines: {lines}; its steps priced "
                   "before the first request; clients do not retry a refusal",
          router=f"snapshots every {fleet['refresh_s']:g} s of simulated time; "
                 f"prefix_affinity's margins {fleet['router_margin_pages']} pages and "
                 f"{fleet['router_margin_s']:g} s",
          requests="; ".join(f"{replicas} replicas: {per_replica} requests per replica per run"
                             for replicas, per_replica in scale.fleets)
          + " (the seconds of arrivals each run holds: `arrival_window_s`)",
          goodput="the share of offered requests finished within both SLOs (a rejected "
                  "request counts against it)",
          imbalance="the fullest pool's KV use over the mean pool's, each averaged over "
                    f"{fleet_lib.IMBALANCE_SAMPLES} instants of the run",
          refused_while_room="arrivals a replica refused while another replica admitted "
                             "them at the same moment (door retries found the room)",
          tie=f"figures within {TIE:.0%} of each other are a tie for the claims",
          seeds="a claim holds or fails on the means over seeds only where each seed's own "
                "table (one trace, every policy) does not decide it the other way; else it "
                "is undecided"),
      arrival_window_s=window, measured=measured, table=table, winners=winners(table),
      seed_tables=by_seed, claims=claims_of(table, measured, by_seed), premises=premises,
      rows=rows)


# The figures. matplotlib is imported inside: the study runs without it.

def _loads(by_load: Mapping[str, Any]) -> list[str]:
  return sorted(by_load, key=lambda load: float(load.rstrip("x")))


def _caption(record: dict[str, Any]) -> str:
  scale = record["scale"]
  return (f"{record['setup']}, simulated; context {record['context']:,}; "
          f"{record['rules']['requests']}; {scale['seeds']} seed(s)\n"
          f"{record['rules']['replicas']}\n{record['rules']['slo']}")


def _panels(record: dict[str, Any], columns: Sequence[tuple[str, str, float]], title: str):
  """One row per (traffic, replicas), one column per (metric, label, scale): each
  policy's mean against the load."""
  import matplotlib.pyplot as plt

  from experiments import plots

  table = record["table"]
  combos = [(t, r) for t in table for r in sorted(table[t], key=int)]
  colours = {p: plt.get_cmap("tab10")(i) for i, p in enumerate(POLICIES)}
  # Dotted over solid: prefix_affinity with no prefix to follow ranks as kv_headroom does.
  styles = dict(zip(POLICIES, ("-", "--", "-", ":"), strict=True))
  figure, axes = plt.subplots(len(combos), len(columns),
                              figsize=(4.4 * len(columns), 3.1 * len(combos)), squeeze=False,
                              constrained_layout=True)
  for row, (traffic, replicas) in enumerate(combos):
    by_load = table[traffic][replicas]
    loads = _loads(by_load)
    measured = record["measured"][traffic]
    for column, (metric, label, factor) in enumerate(columns):
      ax = axes[row, column]
      for policy in POLICIES:
        xs, means, low, high = [], [], [], []
        for load in loads:
          mean = by_load[load].get(policy, {}).get(metric)
          if mean is None:
            continue
          seeds = [t[traffic][replicas][load][policy].get(metric)
                   for t in record["seed_tables"].values()]
          seeds = [factor * v for v in seeds if v is not None] or [factor * mean]
          xs.append(float(load.rstrip("x")))
          means.append(factor * mean)
          low.append(max(0.0, factor * mean - min(seeds)))
          high.append(max(0.0, max(seeds) - factor * mean))
        if xs:
          ax.errorbar(xs, means, yerr=[low, high], marker="o", ms=3, capsize=2, lw=1.2,
                      ls=styles[policy], color=colours[policy], label=policy)
      if not any(by_load[load][p].get(metric) for load in loads for p in by_load[load]):
        ax.set_ylim(0, 1)  # say so, rather than draw an empty panel around zero
        ax.text(0.5, 0.5, "0 under every policy", transform=ax.transAxes, ha="center",
                va="center", fontsize=8)
      if metric in ("ttft_p99_s", "tpot_p99_s"):  # (the replicas' lines bound them: linear)
        slo = factor * measured[{"ttft_p99_s": "slo_ttft_s", "tpot_p99_s": "slo_tpot_s"}[metric]]
        ax.set_ylim(0, 1.15 * max(ax.get_ylim()[1], slo))
        plots.threshold(ax, slo, f"SLO {slo:.3g} {'s' if factor == 1 else 'ms'}")
      elif metric == "goodput_fraction":
        ax.set_ylim(0, 105)
        plots.threshold(ax, 100 * line_study.ATTAINMENT,
                        f"{line_study.ATTAINMENT:.0%} (sustainable)")
      elif metric == "pool_imbalance":
        plots.threshold(ax, 1.0, "even")
      ax.set_xscale("log")
      ax.set_xticks([float(load.rstrip("x")) for load in loads], loads)
      ax.minorticks_off()
      one = measured["replica_sustainable_requests_per_s"]
      ax.set_xlabel(f"load (x {int(replicas)} x {one:.3g} req/s)", fontsize=7)
      ax.set_ylabel(label, fontsize=8)
      ax.set_title(f"{traffic}, {replicas} replicas", fontsize=8)
      ax.grid(alpha=0.3)
  plots.legend_outside(axes[0, -1])
  figure.suptitle(f"{title} (mean over seeds, bars: min-max)\n{_caption(record)}",
                  fontsize=8)
  return figure


def figures(record: dict[str, Any]):
  """The two figures, one row per traffic and fleet size, each policy a line against
  the load: goodput (the attainment of the sustainable rate drawn), TTFT and TPOT p99
  (the SLOs drawn) and refusals while another replica had room; and how the pools fill: their
  imbalance over time, the prefix hit rate and the requests the fleet refused."""
  goodput = _panels(record, (
      ("goodput_fraction", "within both SLOs (% of offered)", 100.0),
      ("ttft_p99_s", "TTFT p99 of the served (s)", 1.0),
      ("tpot_p99_s", "TPOT p99 of the served (ms)", 1e3),
      ("refused_while_room_fraction", "refused while another had room (%)", 100.0)),
      "goodput, latencies and misrouted refusals against the load, per routing policy")
  pools = _panels(record, (
      ("pool_imbalance", "max/mean KV use, time-averaged", 1.0),
      ("prefix_hit_rate", "prefix-cache hit rate (%)", 100.0),
      ("rejected_fraction", "refused by every replica (% of offered)", 100.0)),
      "how the pools fill, per routing policy")
  return goodput, pools


def _value(value: float | None, spec: str) -> str:
  return "n/a" if value is None else format(value, spec)


def format_report(record: dict[str, Any]) -> str:
  lines = [f"fleet study on {record['setup']}: {record['rules']['slo']}",
           f"  {record['rules']['replicas']}"]
  for traffic, m in record["measured"].items():
    lines.append(f"  {traffic}: one replica sustains {m['replica_sustainable_requests_per_s']:.2f}"
                 f" req/s; SLOs TTFT {m['slo_ttft_s']:.2f} s, TPOT {1e3 * m['slo_tpot_s']:.0f} ms")
  header = (f"    {'policy':<16}{'goodput':>8}{'req/s':>8}{'TTFT p99':>10}{'refused':>9}"
            f"{'429/503':>9}{'room':>7}{'retries':>8}{'kv room':>8}{'max/mean':>9}"
            f"{'peak':>6}{'prefix':>8}")
  for traffic, by_replicas in record["table"].items():
    for replicas, by_load in by_replicas.items():
      for load in _loads(by_load):
        window = record["arrival_window_s"][traffic][replicas][load]
        offered = next(iter(by_load[load].values()))["num_requests"]
        lines.append(f"  {_where(traffic, replicas, load)} ({offered:.0f} requests, "
                     f"{window:.1f} s of arrivals):")
        lines.append(header)
        for policy, f in by_load[load].items():
          statuses = f"{f['rejected_429']:.0f}/{f['rejected_503']:.0f}"
          lines.append(
              f"    {policy:<16}{f['goodput_fraction']:>8.1%}"
              f"{f['goodput_requests_per_s']:>8.2f}{_value(f['ttft_p99_s'], '.2f') + ' s':>10}"
              f"{f['num_rejected']:>9.1f}{statuses:>9}"
              f"{f['refused_while_room']:>7.1f}{f['door_retries']:>8.0f}"
              f"{f['refused_with_kv_room']:>8.1f}{_value(f['pool_imbalance'], '.2f'):>9}"
              f"{_value(f['pool_peak_imbalance'], '.2f'):>6}"
              f"{_value(f['prefix_hit_rate'], '.1%'):>8}")
  for claim in record["claims"]:
    lines.append(f"  [{claim['verdict']}] {claim['claim']}: {claim['evidence']}")
  return "\n".join(lines)


def write(record: dict[str, Any], directory: pathlib.Path) -> list[str]:
  """The figures and `study.json` (the record less its rows, which `fleet/` keeps) into
  `directory`; returns their names."""
  from experiments import plots

  goodput, pools = figures(record)
  plots.save(goodput, directory / "goodput_by_load.png")
  plots.save(pools, directory / "pools_by_policy.png")
  study = {key: value for key, value in record.items() if key != "rows"}
  cli.write_files(directory, {"study.json": json.dumps(study, indent=2)})
  return ["study.json", "goodput_by_load.png", "pools_by_policy.png"]


def main(argv: list[str]) -> None:
  del argv  # Unused.
  from experiments import plots  # noqa: F401 (fails now, not after the runs, without matplotlib)

  with cli.workdir(flags.FLAGS.workdir) as directory:
    record = run(SCALES[sim_setups.SCALE.value], directory,
                 setup=sim_setups.SETUPS[sim_setups.SETUP.value])
    written = write(record, directory)
  print(format_report(record))
  print(f"\nwrote {directory}/{', '.join(written)}")


if __name__ == "__main__":
  cli.run(main)
