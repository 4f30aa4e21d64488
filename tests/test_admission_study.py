"""The admission study: each claim holds, fails and says why it cannot decide on a table
made for it; the watermark sweep grows until its optimum is bracketed; and a small run on
the simulator measures its SLOs by the stated rule, judges every claim by them (as
premises), draws them, and resumes with nothing left to run."""

import dataclasses
import json

import pytest

from experiments import admission_study as study
from experiments import plots

PREMISES = dict(slo_ttft_s=1.0, slo_tpot_s=0.05, sustainable_requests_per_s=2.0,
                arrival_rate_per_s=20.0, arrival_window_s=30.0, first_finish_s=8.0)


def figures(goodput: float = 0.5, *, rejected: float = 10, preemptions: float = 0,
            recomputed: float = 0, tpot: float = 0.05, finished: float = 90) -> dict:
  return dict(goodput_fraction=goodput, num_rejected=rejected, num_preemptions=preemptions,
              recomputed_tokens=recomputed, tpot_p99_s=tpot, num_finished=finished)


def table(load: str = "10x", **by_estimate: dict) -> dict:
  return {load: by_estimate}


def goodputs(*values: float, marks=("0.0", "0.15", "0.3")) -> dict:
  return {mark: figures(value, rejected=10 + i) for i, (mark, value)
          in enumerate(zip(marks, values, strict=True))}


def verdict(claim, means: dict, estimate: str = "fixed", **premises) -> str:
  load = next(iter(means))
  return claim(means, load, estimate, {**PREMISES, **premises})["verdict"]


def test_holding_the_line_protects_holds_fails_and_is_undecided():
  def means(zero: dict, top: dict) -> dict:
    return table(fixed={"0.0": zero, "0.15": figures(), "0.3": top})

  protected = means(figures(preemptions=10, recomputed=900), figures(rejected=20))
  assert verdict(study.claim_protects, protected) == "holds"
  worse = means(figures(preemptions=10, recomputed=900), figures(preemptions=12))
  assert verdict(study.claim_protects, worse) == "fails"
  recomputes = means(figures(preemptions=10, recomputed=900),
                     figures(preemptions=2, recomputed=1000))
  assert verdict(study.claim_protects, recomputes) == "fails"
  nothing = means(figures(), figures(rejected=20))  # watermark 0 preempted nothing
  assert verdict(study.claim_protects, nothing) == (
      "undecided: watermark 0.0 preempted nothing: no preemption for the line to prevent")


def test_holding_the_line_keeps_pace_holds_fails_and_is_undecided_when_it_never_triggered():
  def means(zero: dict, top: dict) -> dict:
    return table(fixed={"0.0": zero, "0.3": top})

  assert verdict(study.claim_keeps_pace,
                 means(figures(tpot=0.1), figures(tpot=0.05, rejected=30))) == "holds"
  assert verdict(study.claim_keeps_pace,
                 means(figures(tpot=0.05), figures(tpot=0.06, rejected=30))) == "fails"
  same = verdict(study.claim_keeps_pace, means(figures(tpot=0.05), figures(tpot=0.05)))
  assert same.startswith("undecided: ") and "never triggered" in same
  unmeasured = verdict(study.claim_keeps_pace,
                       means(figures(tpot=0.05), figures(tpot=0.0, rejected=99)))
  assert unmeasured.startswith("undecided: no TPOT")


def test_the_lines_cost_without_overload_holds_fails_and_is_undecided():
  def means(zero: dict, top: dict) -> dict:
    return table("1x", fixed={"0.0": zero, "0.3": top})

  assert verdict(study.claim_costs_unloaded,
                 means(figures(1.0, rejected=0), figures(0.95, rejected=5))) == "holds"
  assert verdict(study.claim_costs_unloaded,
                 means(figures(0.8, rejected=0), figures(0.9, rejected=5))) == "fails"
  # Nothing turned away at any watermark: the same goodput is a tie, not evidence.
  tie = verdict(study.claim_costs_unloaded,
                means(figures(1.0, rejected=0), figures(1.0, rejected=0)))
  assert tie.startswith("undecided: ") and "never triggered" in tie
  zeros = verdict(study.claim_costs_unloaded,
                  means(figures(0.0, rejected=0), figures(0.0, rejected=5)))
  assert zeros == "undecided: neither watermark serves any request within the SLOs"


def test_the_line_pays_holds_inside_the_sweep_fails_at_zero_and_is_undecided_at_its_top():
  assert verdict(study.claim_line_pays, table(fixed=goodputs(0.2, 0.5, 0.3))) == "holds"
  assert verdict(study.claim_line_pays, table(fixed=goodputs(0.5, 0.3, 0.2))) == "fails"
  rising = verdict(study.claim_line_pays, table(fixed=goodputs(0.2, 0.3, 0.5)))
  assert rising == ("undecided: the highest watermark swept (0.3) serves the best goodput: "
                    "the optimum may lie past the sweep")
  plateau = verdict(study.claim_line_pays, table(fixed=goodputs(0.2, 0.5, 0.5)))
  assert plateau.startswith("undecided: the highest watermark swept")
  flat = verdict(study.claim_line_pays, table(fixed=goodputs(0.0, 0.0, 0.0)))
  assert flat == "undecided: goodput is 0.0% at every watermark: nothing to choose"


def test_an_estimate_pays_holds_fails_and_is_undecided():
  def means(mine: dict, reference: dict | None = None) -> dict:
    return table(max_tokens=reference or goodputs(0.2, 0.5, 0.3), running_mean=mine)

  def judge(means: dict, **premises) -> str:
    return verdict(study.claim_estimate_pays, means, "running_mean", **premises)

  assert judge(means(goodputs(0.2, 0.6, 0.3))) == "holds"
  assert judge(means(goodputs(0.2, 0.4, 0.3))) == "fails"
  reference = goodputs(0.2, 0.5, 0.3)
  same = judge(means(json.loads(json.dumps(reference)), reference))
  assert same.startswith("undecided: running_mean ran exactly as max_tokens")
  early = judge(means(goodputs(0.2, 0.6, 0.3)), arrival_window_s=5.0, first_finish_s=8.0)
  assert early.startswith("undecided: arrivals end after 5.0 s, before the first request")
  edged = judge(means(goodputs(0.2, 0.3, 0.6)))
  assert edged == "undecided: the optimum of running_mean lies at the top of its sweep"
  zeros = judge(means(goodputs(0.0, 0.0, 0.0), goodputs(0.0, 0.0, 0.0)))
  assert zeros.startswith("undecided: ")
  # The learning rule binds a running mean only; a fixed estimate learns nothing.
  fixed = study.claim_estimate_pays(
      table(max_tokens=goodputs(0.2, 0.5, 0.3), fixed=goodputs(0.2, 0.6, 0.3)), "10x",
      "fixed", {**PREMISES, "arrival_window_s": 1.0})
  assert fixed["verdict"] == "holds" and fixed["premises"]["slo_tpot_s"] == 0.05


def test_the_sweep_grows_past_its_top_until_the_optimum_is_bracketed_or_capped():
  assert study.optimum(goodputs(0.2, 0.5, 0.3)) == ("0.15", "inside")
  assert study.optimum(goodputs(0.5, 0.3, 0.2)) == ("0.0", "lowest")
  assert study.optimum(goodputs(0.2, 0.5, 0.5)) == ("0.15", "top")
  assert study.optimum(goodputs(0.4, 0.4, 0.4)) == ("0.0", "flat")
  assert study.next_watermark(goodputs(0.2, 0.3, 0.5)) == pytest.approx(0.3 + study.STEP)
  assert study.next_watermark(goodputs(0.2, 0.5, 0.3)) is None
  top = study.MAX_WATERMARK
  capped = goodputs(0.2, 0.3, 0.5, marks=("0.0", "0.3", str(top)))
  assert study.optimum(capped)[1] == "top" and study.next_watermark(capped) is None


def test_the_claims_are_stated_per_load_each_with_its_thresholds():
  marks = goodputs(0.2, 0.5, 0.3)
  means = {"1x": {"max_tokens": marks, "running_mean": marks},
           "10x": {"max_tokens": marks, "running_mean": goodputs(0.2, 0.6, 0.3)}}
  measured = dict(slo_ttft_s=1.0, slo_tpot_s=0.05, sustainable_requests_per_s=2.0,
                  first_finish_s=8.0)
  stated = study.claims(means, measured, num_requests=600)
  assert len(stated) == 2 + 2 * 3 + 1  # the cost at 1x; at 10x pays, protects, pace; estimate
  for claim in stated:
    assert claim["premises"]["slo_ttft_s"] == 1.0 and claim["premises"]["slo_tpot_s"] == 0.05
  assert stated[-1]["premises"]["arrival_window_s"] == pytest.approx(600 / 20.0)


def test_a_small_run_measures_its_slos_judges_by_them_and_resumes(tmp_path):
  scale = dataclasses.replace(study.SCALES["smoke"], num_requests=40,
                              estimates=("max_tokens", "running_mean"), loads=(1, 10))
  record = study.run(scale, tmp_path, show_progress=False)
  measured = record["measured"]
  assert measured["slo_ttft_s"] == pytest.approx(3 * measured["unloaded_ttft_p99_s"], abs=1e-4)
  assert measured["slo_tpot_s"] == pytest.approx(3 * measured["unloaded_tpot_p50_s"], abs=1e-4)
  for row in record["rows"]:  # every run judged by the measured SLOs
    assert row["summary"]["slo"] == dict(ttft_s=measured["slo_ttft_s"],
                                         tpot_s=measured["slo_tpot_s"])
  for load, by_estimate in record["optima"].items():  # bracketed, or the sweep is capped
    for estimate, best in by_estimate.items():
      marks = [float(mark) for mark in record["means"][load][estimate]]
      assert best["where"] != "top" or max(marks) == pytest.approx(study.MAX_WATERMARK)
  assert record["claims"]
  for claim in record["claims"]:
    assert claim["verdict"] in ("holds", "fails") or claim["verdict"].startswith("undecided: ")
    assert claim["premises"]["slo_ttft_s"] == measured["slo_ttft_s"]
  figure = study.figure(record)
  texts = [text.get_text() for axes in figure.axes for text in axes.texts]
  assert any(text.startswith("SLO") for text in texts)
  for axes in figure.axes:
    assert axes.get_xlabel() and axes.get_ylabel() and axes.get_title()
  plots.save(figure, tmp_path / "admission.png")
  runs = (tmp_path / "runs" / "results.jsonl").read_text().splitlines()
  again = study.run(scale, tmp_path, show_progress=False)
  assert (tmp_path / "runs" / "results.jsonl").read_text().splitlines() == runs
  assert again["claims"] == record["claims"]
  assert "[" in study.format_report(record)
