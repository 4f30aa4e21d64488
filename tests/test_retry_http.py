"""`benchmarks/retry_http.py`: its figures from made-up records (first-retry admission
by reason, the ETA's accuracy, the audit's histograms read as deltas), then end to end
at its smallest (`--smoke`: a real server, a few seconds of arrivals), the verdict
recomputed from the record's own numbers. Whether the hints meet the issue's bars is
the benchmark's finding, not asserted here."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("uvicorn")

from benchmarks import retry_rules  # after the skips: it imports aiohttp
from benchmarks.load_client import Attempt, RequestRecord

ROOT = pathlib.Path(__file__).resolve().parents[1]


def record(*attempts: tuple[int, str | None, bool], statuses=(), chunks=()) -> RequestRecord:
  out = RequestRecord(0, 0.0, statuses=list(statuses), chunk_times_s=list(chunks))
  for status, reason, honoured in attempts:
    out.attempts.append(Attempt(0.0, status=status, reason=reason, honoured_hint=honoured))
  return out


def test_first_retry_admission_is_counted_by_the_first_refusals_reason():
  records = [record((429, "queue_full", False), (200, None, True)),
             record((429, "queue_full", False), (429, "queue_full", True), (200, None, True)),
             record((503, "kv_pressure", False), (200, None, False)),  # not at the hint
             record((200, None, False))]
  figures = retry_rules.first_retries(records)
  assert figures["queue_full"] == dict(refused_first=2, retried_at_hint=2, admitted=1,
                                       admitted_fraction=0.5)
  assert figures["kv_pressure"]["admitted_fraction"] is None  # no retry at the hint


def test_the_eta_is_judged_from_the_first_waiting_status():
  within = record(statuses=[(1.0, "queueing", 2.0), (1.5, "queueing", 0.1)], chunks=[3.5])
  late = record(statuses=[(1.0, "queueing", 0.5)], chunks=[3.0])  # 2.0 s for 0.5 s
  never_waited = record(statuses=[(1.0, "running", 0.0)], chunks=[1.1])
  figures = retry_rules.eta_accuracy([within, late, never_waited])
  assert (figures["waiting_requests"], figures["within"]) == (2, 1)
  assert figures["within_fraction"] == 0.5


def test_the_audit_is_read_as_the_runs_delta_with_the_median_bucket():
  before = {"queue_full": {"le=1.0": 1, "le=2.0": 1, "le=+Inf": 1, "count": 1}}
  after = {"queue_full": {"le=1.0": 2, "le=2.0": 3, "le=+Inf": 5, "count": 5,
                          "unresolved": 1},
           "kv_pressure": {"le=1.0": 0, "le=2.0": 0, "le=+Inf": 0, "count": 0}}
  delta = retry_rules.audit_delta(before, after)
  assert list(delta) == ["queue_full"]  # nothing audited for kv_pressure in this run
  assert delta["queue_full"] == dict(audited=4, median_ratio_bucket="(1, 2]", within_bar=2,
                                     within_bar_fraction=0.5, unresolved=1)


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
  directory = tmp_path_factory.mktemp("retry_http")
  cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(directory / "jax_cache")
  out = directory / "result.json"
  done = subprocess.run(
      [sys.executable, "-m", "benchmarks.retry_http", "--smoke", f"--out={out}",
       f"--compilation_cache={cache}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout + done.stderr
  assert f"wrote {out}" in done.stdout
  return json.loads(out.read_text())


def test_a_smoke_run_records_its_premises_and_judges_from_its_own_numbers(result):
  premises = result["premises"]
  assert premises["config"] == "configs/tiny.py" and premises["num_pages"] == 48
  assert "--config.server.retry_audit=512" in premises["server_flags"]
  assert premises["packages"]["jax"] and premises["arrival_process"] == "poisson"
  assert result["measured"]["one_x_per_s"] > 0
  kinds = {run["deadline_s"] for run in result["runs"]}
  assert kinds == {None, 1.0}
  for run in result["runs"]:
    assert run["verdict"] == retry_rules.judge(run)
    refused = run["reasons"]
    for reason, audit in run["audit"].items():
      # Every audited refusal was a refusal this run's clients saw.
      assert 0 < audit["audited"] <= refused.get(reason, 0)
    for reason, first in run["first_retries"].items():
      assert first["admitted"] <= first["retried_at_hint"] <= first["refused_first"]
      assert reason in refused
