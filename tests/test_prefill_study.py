"""The chunked-prefill study: each claim holds, fails and is undecided on a table made for
it; a small simulated run states its measured SLOs, searches capacity in resumable
sweep cells and resumes without rerunning; the command writes study.json and the figure.
(The whole study at smoke scale, tiny and quality parts included, runs in
tests/test_notebooks.py through its notebook.)"""

import dataclasses
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from experiments import claims, prefill_study

ROOT = pathlib.Path(__file__).resolve().parents[1]
BUDGET = 4096
RATES = (1.0, 2.0)
SLOS = {"tpot_p99_s": 0.035, "itl_p99_s": 0.1}


def entry(chunk: int, figures: dict, capacity: dict | None) -> dict:
  """One policy's figures: `figures[metric][rate index][seed index]`."""
  def spread(values: list) -> dict:
    present = [value for value in values if value is not None]
    return dict(by_seed=values, mean=float(np.mean(present)), min=min(present),
                max=max(present))

  by_rate = {prefill_study.rate_text(rate): {metric: spread(values[index])
                                             for metric, values in figures.items()}
             for index, rate in enumerate(RATES)}
  return dict(prefill_policy="none" if chunk == 0 else "chunked", chunk_size=chunk,
              budget=BUDGET, by_rate=by_rate,
              capacity=capacity or dict.fromkeys(prefill_study.SLO_FACTORS))


def table(figures: dict[int, dict], capacities: dict[int, dict] | None = None) -> dict:
  """An analysis of policies by chunk size (0: prefill-first), two rates, two seeds."""
  policies = {f"chunk {chunk}": entry(chunk, by_metric, (capacities or {}).get(chunk))
              for chunk, by_metric in figures.items()}
  return dict(seeds=[0, 1], rates=list(RATES), slos=SLOS, policies=policies,
              unloaded=dict(rule="2x / 5x the unloaded median TPOT",
                            unloaded_tpot_p50_s=0.0175),
              search=dict(max_rate=16.0, tolerance=0.05) if capacities else None)


def flat(value: float) -> list[list[float]]:
  return [[value, value] for _ in RATES]


@pytest.mark.parametrize("metric", ["max_stall_s", "itl_p99_s"])
def test_chunking_cuts_a_tail_holds_fails_and_is_undecided(metric):
  judge = lambda figures: prefill_study.claim_below_prefill_first(table(figures), BUDGET,
                                                                  metric)
  held = judge({0: {metric: flat(0.5)}, 256: {metric: flat(0.1)}, 2048: {metric: flat(0.3)}})
  assert held["verdict"] == "holds" and held["holds_at"] == list(RATES)
  # At 1 req/s one seed of chunk 2048 stalls longer: it fails there, holds at 2 req/s.
  failed = judge({0: {metric: flat(0.5)}, 256: {metric: flat(0.1)},
                  2048: {metric: [[0.3, 0.6], [0.3, 0.3]]}})
  assert failed["verdict"] == "fails"
  assert failed["holds_at"] == [2.0] and failed["fails_at"] == [1.0]
  assert "holds at 2 req/s, fails at 1" in failed["evidence"]
  alone = judge({0: {metric: flat(0.5)}})
  assert alone["verdict"].startswith("undecided: no prefill-first and chunked pair")
  missing = judge({0: {metric: flat(0.5)}, 256: {metric: [[0.1, None], [0.1, 0.1]]}})
  assert missing["verdict"] == "undecided: figures missing at 1 req/s"


def test_the_ttft_cost_holds_fails_and_is_undecided_with_one_chunk_size():
  judge = lambda figures: prefill_study.claim_ttft_cost(table(figures), BUDGET)
  ttft = lambda value: {"ttft_p99_s": flat(value)}
  assert judge({0: ttft(0.4), 256: ttft(0.8), 2048: ttft(0.5)})["verdict"] == "holds"
  assert judge({0: ttft(0.4), 256: ttft(0.5), 2048: ttft(0.5)})["verdict"] == "fails"
  one = judge({0: ttft(0.4), 256: ttft(0.8)})
  assert one["verdict"] == "undecided: fewer than two chunk sizes to compare"


def capacity(limit: float | None) -> dict:
  """A real search against an SLO that breaks past `limit` (None: never breaks)."""
  meets = (lambda rate: True) if limit is None else (lambda rate: rate <= limit)
  return claims.search_capacity(meets, 1.0, max_rate=16.0, min_rate=0.125).to_dict()


@pytest.mark.parametrize("metric", list(prefill_study.SLO_FACTORS))
def test_the_capacity_claim_holds_fails_and_is_undecided(metric):
  def judge(first: float | None, chunk: float | None, searched: bool = True) -> dict:
    capacities = {0: {metric: capacity(first)}, 256: {metric: capacity(chunk)}}
    figures = {0: {}, 256: {}}
    return prefill_study.claim_capacity(table(figures, capacities if searched else None),
                                        BUDGET, metric)

  held = judge(2.2, 3.7)
  assert held["verdict"] == "holds"
  assert held["premises"]["slo_s"] == SLOS[metric]  # the threshold beside the verdict
  assert held["premises"]["search"]["max_rate"] == 16.0
  assert judge(2.2, None)["verdict"] == "holds"  # a lower bound past where it broke
  assert judge(3.7, 2.2)["verdict"] == "fails"
  assert judge(3.7, 3.7)["verdict"] == ("undecided: the capacities overlap within the "
                                        "search's resolution")
  never = judge(None, None)
  assert never["verdict"].startswith("undecided: every policy meets the SLO up to the "
                                     "search's end (16 req/s)")
  assert judge(0.01, 0.01)["verdict"] == ("undecided: no policy meets the SLO even at the "
                                          "lowest rate searched")
  assert judge(2.2, 3.7, searched=False)["verdict"] == ("undecided: capacity not searched "
                                                        "at this scale")


def test_the_quality_claim_holds_fails_and_is_undecided():
  row = lambda dtype, agreement, gap: dict(dtype=dtype, chunk_size=16, token_agreement=agreement,
                                           max_logit_diff_relative=gap)
  assert prefill_study.claim_quality([row("fp32", 1.0, 1e-7)])["verdict"] == "holds"
  assert prefill_study.claim_quality([row("fp32", 1.0, 1e-2)])["verdict"] == "fails"
  assert prefill_study.claim_quality([row("fp32", 0.5, 0.0)])["verdict"] == "fails"
  assert prefill_study.claim_quality([row("bf16", 1.0, 0.0)])["verdict"] == "undecided: no fp32 run"


def test_a_small_run_measures_its_slos_searches_capacity_and_resumes(tmp_path):
  scale = dataclasses.replace(prefill_study.SCALES["smoke"], sim_requests=24, sim_rates=(2, 4))
  record = prefill_study.run(scale, tmp_path, ("sim",), show_progress=False)
  analysis = record["sim"]["analysis"]
  tpot = analysis["unloaded"]["unloaded_tpot_p50_s"]
  assert analysis["slos"] == {"tpot_p99_s": pytest.approx(2 * tpot),
                              "itl_p99_s": pytest.approx(5 * tpot)}
  rows = (tmp_path / "sim" / "results.jsonl").read_text().splitlines()
  probed = {prefill_study.rate_text(rate) for entry in analysis["policies"].values()
            for found in entry["capacity"].values() for rate, _ in found["probes"]}
  ran = {json.loads(row)["cell"]["arrival_rate"] for row in rows}
  assert probed | {"2", "4"} == ran  # every probe is a sweep cell, and nothing else ran
  for stated in record["sim"]["claims"].values():
    for claim in stated:
      assert claim["verdict"] in ("holds", "fails") or claim["verdict"].startswith("undecided: ")
  assert {*stated[3]["premises"]} >= {"slo_s", "slo_rule", "search"}
  again = prefill_study.run(scale, tmp_path, ("sim",), show_progress=False)
  assert (tmp_path / "sim" / "results.jsonl").read_text().splitlines() == rows  # all resumed
  assert again["sim"]["analysis"] == analysis


def test_the_command_writes_the_record_and_the_figure(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "experiments.prefill_study", "--scale=smoke", "--parts=sim",
       f"--workdir={tmp_path}", "--compilation_cache="],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  record = json.loads((tmp_path / "study.json").read_text())
  (stated,) = record["sim"]["claims"].values()
  assert len(stated) == 5 and all(claim["verdict"] in result.stdout for claim in stated)
  assert (tmp_path / "sim_curves.png").stat().st_size > 0
  csv_lines = (tmp_path / "sim" / "results.csv").read_text().splitlines()
  jsonl_lines = (tmp_path / "sim" / "results.jsonl").read_text().splitlines()
  assert len(csv_lines) == len(jsonl_lines) + 1  # the table holds every run, probes too
