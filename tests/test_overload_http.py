"""`benchmarks/overload_http.py` end to end at its smallest (`--smoke`: real servers, a
few dozen requests), and its verdict recomputed from the record's own numbers. Whether
a line meets the bullet is the benchmark's finding, not asserted here: speed is for
benchmarks, not tests."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("uvicorn")

from benchmarks import overload_rules  # after the skips: it imports aiohttp
from experiments import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUN_KEYS = {"num_requests", "served", "served_fraction", "ttft_p50_s", "ttft_p95_s",
            "ttft_p99_s", "tpot_p50_s", "rejections", "rejection_reasons", "num_rejections",
            "failures", "unfinished", "wall_s", "rate", "seed"}


@pytest.fixture(scope="module")
def record(tmp_path_factory) -> dict:
  directory = tmp_path_factory.mktemp("overload_http")
  cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(directory / "jax_cache")
  out = directory / "result.json"
  done = subprocess.run(
      [sys.executable, "-m", "benchmarks.overload_http", "--smoke", f"--out={out}",
       f"--compilation_cache={cache}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout + done.stderr
  assert "verdict:" in done.stdout and f"wrote {out}" in done.stdout
  return json.loads(out.read_text())


def test_the_record_names_its_premises_and_rules(record):
  premises = record["premises"]
  assert premises["config"] == "configs/tiny.py" and premises["dtype"] == "fp32"
  assert (premises["prompt_len"], premises["output_len"]) == (32, 8)
  assert premises["scheduler"]["max_num_seqs"] == overload_rules.SMOKE_SCHEDULER["max_num_seqs"]
  assert "--config.scheduler.max_num_seqs=8" in premises["overrides"]
  # The pool is what --kv_memory_gib holds, far more pages than a request needs.
  assert premises["num_pages"] > 100 * premises["pages_per_request"]
  assert premises["packages"]["jax"] and premises["cpu_count"]
  assert premises["server_models"]["data"][0]["id"] == "tiny"
  assert set(record["rules"]) >= {"unloaded", "slo", "sustainable", "min_served_fraction"}
  assert record["overload"]["arrival_process"] == "poisson"


def test_the_slo_and_rates_follow_the_stated_rules(record):
  measured, overload = record["measured"], record["overload"]
  assert measured["capacity_rule"] == "at_once"
  at_once = measured["at_once"]
  assert measured["throughput_at_once_per_s"] == pytest.approx(
      at_once["served"] / at_once["wall_s"])
  assert measured["sustainable_per_s"] == measured["throughput_at_once_per_s"]
  assert measured["slo_ttft_s"] == round(3 * measured["unloaded"]["ttft_p99_s"], 4)
  assert measured["slo_tpot_s"] == round(3 * measured["unloaded"]["tpot_p50_s"], 4)
  assert overload["rate_per_s"] == pytest.approx(5 * measured["sustainable_per_s"])


def test_every_line_reports_its_runs(record):
  lines = record["lines"]
  assert list(lines) == ["default", "wait:1"]
  assert lines["default"]["settings"] == {}
  # The shipped tiny server holds its serving line; a wait line takes its place.
  assert lines["default"]["server_admission"].endswith(
      "forecast TTFT line 0.05 s (server.ttft_line_s)")
  assert "max_forecast_ttft_s" in lines["wait:1"]["server_admission"]
  assert lines["wait:1"]["settings"] == {
      "max_forecast_ttft_s": round(record["measured"]["slo_ttft_s"], 4)}
  for line in lines.values():
    runs = [*line["runs"], line["low_load"]]
    assert len(line["runs"]) == len(record["overload"]["seeds"]) == 1
    for run in runs:
      assert set(run) >= RUN_KEYS
      assert run["served_fraction"] == run["served"] / run["num_requests"]
      # Every request is served, rejected (retries are off) or counted as failed.
      assert run["num_rejections"] == sum(run["rejections"].values()) == sum(
          run["rejection_reasons"].values())
      assert run["served"] + sum(run["failures"].values()) + run["unfinished"] == \
          run["num_requests"]
      if run["served"]:
        assert run["ttft_p50_s"] <= run["ttft_p95_s"] <= run["ttft_p99_s"]
    assert line["summary"]["served_fraction"]["mean"] == pytest.approx(
        sum(run["served_fraction"] for run in line["runs"]) / len(line["runs"]))
  # Whatever the wait line refused, it refused as the forecast-wait line.
  assert set(lines["wait:1"]["runs"][0]["rejection_reasons"]) <= {"wait_forecast"}


def test_the_verdict_is_computed_from_the_records_own_numbers(record):
  slo = record["measured"]["slo_ttft_s"]
  verdict = record["verdict"]
  assert verdict == overload_rules.judge(record["lines"], slo)
  for name, line in record["lines"].items():  # and by hand, from the runs' figures
    holds = all(run["ttft_p95_s"] is not None and run["ttft_p95_s"] <= slo
                and run["served_fraction"] >= 0.3 for run in line["runs"])
    assert verdict["holds"][name] is holds
  assert verdict["default_holds"] is verdict["holds"]["default"]


def _run(p95: float | None, served: float, rejections: int = 0) -> dict:
  return dict(ttft_p95_s=p95, served_fraction=served, num_rejections=rejections)


def _line(runs: list[dict], low_rejections: int | None = 0, wait: float | None = None,
          slowdown: float | None = None) -> dict:
  settings = ({} if wait is None else {"max_forecast_ttft_s": wait}) | (
      {} if slowdown is None else {"max_ttft_slowdown": slowdown})
  return dict(runs=runs, settings=settings,
              low_load=None if low_rejections is None else _run(0.01, 1.0, low_rejections))


def test_judge_holds_only_in_every_seed_and_recommends_a_quiet_line():
  lines = {
      "default": _line([_run(0.5, 1.0), _run(0.05, 1.0)]),  # one seed over the SLO
      "wait:0.5": _line([_run(0.05, 0.5)], low_rejections=3, wait=0.05),  # refuses at 1x
      "wait:1": _line([_run(0.09, 0.4), _run(0.08, 0.45)], wait=0.1),
      "wait:2": _line([_run(0.09, 0.6), _run(0.2, 0.6)], wait=0.2),  # a seed over the SLO
      "wait:0.7": _line([_run(0.07, 0.2)], wait=0.07),  # serves too little
      "tokens:1": _line([_run(0.05, 0.9)]),  # holds, but is not stated in seconds
      "wait:1+step_tokens:256": _line([_run(0.05, 0.9)], wait=0.1),  # not the wait alone
  }
  verdict = overload_rules.judge(lines, slo_ttft_s=0.1)
  assert verdict["holds"] == {"default": False, "wait:0.5": True, "wait:1": True,
                              "wait:2": False, "wait:0.7": False, "tokens:1": True,
                              "wait:1+step_tokens:256": True}
  assert verdict["default_holds"] is False
  assert verdict["quiet_at_low_load"]["wait:0.5"] is False
  assert (verdict["recommended"], verdict["recommended_settings"]) == (
      "wait:1", {"max_forecast_ttft_s": 0.1})
  assert overload_rules.judge({"default": _line([_run(None, 0.0)])}, 0.1)["recommended"] is None
  # A holding, quiet slowdown line comes first, even serving less than a wait line.
  lines["slowdown:4"] = _line([_run(0.09, 0.35)], slowdown=4.0)
  lines["slowdown:8"] = _line([_run(0.2, 0.5)], slowdown=8.0)  # over the SLO
  verdict = overload_rules.judge(lines, slo_ttft_s=0.1)
  assert (verdict["recommended"], verdict["recommended_settings"]) == (
      "slowdown:4", {"max_ttft_slowdown": 4.0})


@pytest.mark.parametrize("line, settings", [
    ("default", {}), ("wait:0.5", {"max_forecast_ttft_s": 0.05}),
    ("tokens:2", {"max_inflight_tokens": 200}),
    ("wait:0.25+step_tokens:256", {"max_forecast_ttft_s": 0.025, "max_num_batched_tokens": 256}),
    ("slowdown:4", {"max_ttft_slowdown": 4.0}),
    ("none", {"admission": "queue_only", "max_waiting": 0, "rate_limit": 0.0,
              "max_concurrent": 0, "max_inflight_tokens": 0, "max_forecast_ttft_s": 0.0,
              "max_ttft_slowdown": 0.0, "server.ttft_line_s": 0.0})])
def test_lines_parse_into_scheduler_settings(line, settings):
  assert overload_rules.line_settings(line, slo_ttft_s=0.1, batch_tokens=100) == settings


@pytest.mark.parametrize("lines", [["wait"], ["wait:0"], ["tokens:-1"], ["kv"], ["wait:inf"],
                                   ["wait:1+wait:2"], ["step_tokens:1.5"], ["none+wait:1"],
                                   ["slowdown:0.5"], ["default", "default"], []])
def test_bad_lines_are_refused_before_any_server_starts(lines):
  with pytest.raises(cli.UsageError):
    overload_rules.check_lines(lines)


def test_request_counts_stay_in_bounds():
  assert overload_rules.num_requests(100.0, 20.0, 40, 2000) == 2000
  assert overload_rules.num_requests(1.0, 20.0, 40, 2000) == 40
  assert overload_rules.num_requests(10.0, 20.0, 40, 2000) == 200
  assert overload_rules.plain({"a": [math.inf, 1.0]}) == {"a": ["inf", 1.0]}
