"""The line study: each claim can hold, fail and be undecided on a table made for it; a
cell's line reads back from its keys; and a small run on the simulator carries its
thresholds as premises, a verdict per claim and both figures."""

import dataclasses

import pytest

from experiments import line_study


def entry(goodput: float, knob: str = "1", at_edge: bool = False) -> dict:
  figures = {"goodput_requests_per_s": goodput, "goodput_token_fraction": goodput / 10}
  return {"best_knob": knob, "best": figures, "best_tokens_knob": knob, "best_tokens": figures,
          "best_at_edge": at_edge, "by_knob": {knob: figures}}


def table(**goodputs: float) -> dict:
  lines = {line.replace("_", "+"): entry(value) for line, value in goodputs.items()}
  return {"mix": {"steady": {"5x": lines}}}


ALL = dict(none=0.1, rate=0.5, concurrency=0.6, queue=0.2, tokens=0.7, kv=0.9, wait=0.4,
           slowdown=0.3, kv_wait=1.0)


def verdict(claim, **goodputs) -> str:
  return claim(table(**{**ALL, **goodputs}), "mix", "steady", "5x")["verdict"]


def test_a_line_beats_none_holds_fails_and_is_undecided():
  assert verdict(line_study.claim_line_beats_none) == "holds"
  assert verdict(line_study.claim_line_beats_none, none=2.0) == "fails"
  zeros = dict.fromkeys(ALL, 0.0)
  assert verdict(line_study.claim_line_beats_none, **zeros).startswith("undecided: ")


def test_the_kv_line_wins_holds_fails_and_is_undecided():
  assert verdict(line_study.claim_kv_wins) == "holds"
  assert verdict(line_study.claim_kv_wins, kv_wait=0.5, kv=0.5) == "fails"  # tokens 0.7
  assert verdict(line_study.claim_kv_wins, tokens=1.04) == "holds"  # within 5%
  zeros = dict.fromkeys(ALL, 0.0)
  assert verdict(line_study.claim_kv_wins, **zeros).startswith("undecided: ")


def test_the_kv_line_wins_in_tokens_holds_fails_and_is_undecided():
  # Weighted by prompt tokens, with each line's best knob for that measure.
  assert verdict(line_study.claim_kv_wins_tokens) == "holds"
  assert verdict(line_study.claim_kv_wins_tokens, kv_wait=0.5, kv=0.5) == "fails"
  assert verdict(line_study.claim_kv_wins_tokens, tokens=1.04) == "holds"  # within 5%
  assert verdict(line_study.claim_kv_wins_tokens, tokens=1.06) == "fails"
  zeros = dict.fromkeys(ALL, 0.0)
  assert verdict(line_study.claim_kv_wins_tokens, **zeros).startswith("undecided: ")
  # The token measure is read at each line's own best knob for it, not the request one.
  tuned = table(**ALL)
  tuned["mix"]["steady"]["5x"]["tokens"]["best_tokens"] = {"goodput_token_fraction": 0.5}
  assert line_study.claim_kv_wins_tokens(tuned, "mix", "steady", "5x")["verdict"] == "fails"


def test_the_combination_claim_holds_fails_and_is_undecided_at_a_sweeps_edge():
  assert verdict(line_study.claim_combination_needed) == "holds"  # 1.0 vs kv 0.9
  assert verdict(line_study.claim_combination_needed, wait=1.5) == "fails"
  assert verdict(line_study.claim_combination_needed, kv=0.96) == "fails"  # a 4% gain: a tie
  edged = table(**ALL)
  edged["mix"]["steady"]["5x"]["kv"]["best_at_edge"] = True
  claim = line_study.claim_combination_needed(edged, "mix", "steady", "5x")
  assert claim["verdict"] == ("undecided: the optimum of kv is not bracketed (at the edge of "
                              "its sweep, or fewer than three values)")


def shipped_table(shipped: dict | None, **goodputs: float) -> dict:
  """`table` with the shipped line run at its best watermark 0.3 and, unless `shipped` is
  None, at the shipped watermark with the figures `shipped` gives."""
  made = table(**{**ALL, **goodputs})
  watermark = str(line_study.SHIPPED_WATERMARK)
  by_knob = {"0.3": {"goodput_requests_per_s": 0.95, "num_preemptions": 0.0,
                     "num_aborted": 0.0}}
  if shipped is not None:
    by_knob[watermark] = {"goodput_requests_per_s": 0.9, "num_preemptions": 0.0,
                          "num_aborted": 0.0, **shipped}
  made["mix"]["steady"]["5x"]["shipped"] = {
      "best_knob": "0.3", "best": by_knob["0.3"], "by_knob": by_knob}
  return made


def test_the_shipped_default_serves_holds_fails_and_is_undecided():
  def verdict_of(shipped, **goodputs):
    return line_study.claim_shipped_serves(shipped_table(shipped, **goodputs), "mix",
                                           "steady", "5x")["verdict"]

  # Read at the shipped watermark (0.96 there), not the shipped line's best (0.3).
  assert verdict_of({"goodput_requests_per_s": 0.96}) == "holds"  # kv+wait 1.0: within 5%
  assert verdict_of({}) == "fails"  # 0.9 vs 1.0
  assert verdict_of({"goodput_requests_per_s": 0.5}, kv_wait=0.4) == "fails"  # vs kv 0.9
  assert verdict_of(None) == "undecided: the shipped watermark was not run"
  zeros = dict.fromkeys(ALL, 0.0)
  assert verdict_of({"goodput_requests_per_s": 0.0}, **zeros).startswith("undecided: ")


def test_the_shipped_default_keeps_running_requests_holds_fails_and_is_undecided():
  def verdict_of(shipped):
    return line_study.claim_shipped_keeps_running(shipped_table(shipped), "mix", "steady",
                                                  "5x")["verdict"]

  assert verdict_of({}) == "holds"
  assert verdict_of({"num_preemptions": 0.33}) == "fails"
  assert verdict_of({"num_aborted": 1.0}) == "fails"
  assert verdict_of(None) == "undecided: the shipped watermark was not run"


def test_every_knob_setting_reads_back_as_its_line():
  measured = {"sharegpt": dict(sustainable_requests_per_s=2.0, pool_tokens=10000,
                               slo_ttft_s=1.0, slo_tpot_s=0.05)}
  grid = line_study.knob_grid(line_study.SCALES["full"], measured)
  assert list(grid) == list(line_study.LINES)
  for line, settings in grid.items():
    for setting in settings:
      name, knob = line_study.line_of({**line_study.LINE_KEYS, **setting})
      assert name == line
      if line != "none":
        assert knob in setting.values()


def test_a_small_run_states_its_thresholds_and_a_verdict_per_claim(tmp_path):
  scale = dataclasses.replace(line_study.SCALES["smoke"], num_requests=40, loads=(5,),
                              knobs=1)
  record = line_study.run(scale, tmp_path, show_progress=False)
  again = line_study.run(scale, tmp_path, show_progress=False)  # resumed: nothing reruns
  assert again["measured"] == record["measured"] and again["table"] == record["table"]
  for mix, measured in record["measured"].items():
    assert measured["slo_ttft_s"] == pytest.approx(3 * measured["unloaded_ttft_p99_s"],
                                                   abs=1e-4)
    assert measured["slo_tpot_s"] == pytest.approx(3 * measured["unloaded_tpot_p50_s"],
                                                   abs=1e-4)
    # The sustainable rate is a capacity found by search: at it, 90% of requests meet
    # both SLOs with no line; past its bracket, fewer do.
    search = measured["capacity_search"]
    probes = dict(search["probes"])
    assert probes[search["rate"]] and measured["sustainable_requests_per_s"] == search["rate"]
    if search["reached"]:
      assert not probes[search["broken_at"]] and search["broken_at"] > search["rate"]
    by_line = record["table"][mix]["steady"]["5x"]
    assert set(by_line) == set(line_study.LINES)
  # Each run was judged by its mix's SLOs, and the rejected requests count against it.
  for row in record["rows"]:
    assert row["cell"]["slo_ttft"] in {m["slo_ttft_s"]
                                       for m in record["measured"].values()}
  assert len(record["claims"]) == 6 * len(record["measured"])
  # Every line's best setting carries its token-weighted goodput and, per prompt-length
  # class the mix draws, the share within both SLOs (long/short: two classes).
  best = record["table"]["long/short"]["steady"]["5x"]["kv"]["best"]
  assert set(best["by_prompt_length"]) == {"<=256", ">4096"}
  assert 0 <= best["goodput_token_fraction"] <= 1
  for claim in record["claims"]:
    assert claim["verdict"] in ("holds", "fails") or claim["verdict"].startswith("undecided: ")
  assert set(record["robustness"]["steady"]["5x"]) == set(line_study.LINES[1:])
  bars, curves = line_study.figures(record)
  for figure in (bars, curves):
    for axes in figure.axes:
      assert axes.get_ylabel() and (axes.get_xlabel() or axes.get_xticklabels())
  assert "SLO" in " ".join(text.get_text() for axes in bars.axes for text in axes.texts)


MEASURED = {"sharegpt": dict(sustainable_requests_per_s=2.0, pool_tokens=10000, slo_ttft_s=1.0,
                             slo_tpot_s=0.05)}


def test_the_best_setting_is_bracketed_only_inside_a_sweep_of_three_or_more():
  measured = MEASURED

  def rows(goodputs: dict[float, float]) -> list[dict]:
    return [{"cell": {**line_study.LINE_KEYS, "scheduler.admission": "watermark",
                      "scheduler.watermark": watermark, "prompt_len": "lognormal:512:3000",
                      "arrival_process": "poisson", "arrival_rate": "10"},
             "metrics": {"goodput_requests_per_s": goodput}}
            for watermark, goodput in reversed(goodputs.items())]  # any order

  def kv(goodputs):
    return line_study.analyze(rows(goodputs), measured)["sharegpt"]["steady"]["5x"]["kv"]

  inside = kv({0.0: 1.0, 0.15: 2.0, 0.3: 1.5})
  assert inside["best_knob"] == "0.15" and not inside["best_at_edge"]
  assert kv({0.0: 1.0, 0.15: 2.0, 0.3: 2.5})["best_at_edge"]  # rising at the top
  assert kv({0.0: 1.0, 0.15: 2.0})["best_at_edge"]  # two values bracket nothing


def test_a_sweep_extends_along_its_ladder_until_its_optima_are_bracketed():
  kv = [0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]  # the KV ladder
  assert [s["scheduler.watermark"] for s in line_study.ladders(MEASURED)["kv"]] == kv

  def table(goodput, tokens=None) -> dict:
    tokens = tokens or goodput  # the token-weighted goodput peaks where goodput does
    rows = [{"cell": {**line_study.LINE_KEYS, "scheduler.admission": "watermark",
                      "scheduler.watermark": kv[i], "prompt_len": "lognormal:512:3000",
                      "arrival_process": "poisson", "arrival_rate": "10"},
             "metrics": {"goodput_requests_per_s": goodput(kv[i]),
                         "goodput_token_fraction": tokens(kv[i])}} for i in chosen[key]]
    return line_study.analyze(rows, MEASURED)

  key = ("sharegpt", "steady", "5x", "kv")
  first = line_study.first_knobs(line_study.SCALES["full"], kv)
  chosen = {key: list(first)}
  assert [kv[i] for i in chosen[key]] == [0.15, 0.2, 0.3, 0.4, 0.5]
  peak = lambda w: -abs(w - 0.7)  # the optimum lies past the first sweep
  rounds = 0
  while line_study.extensions(table(peak), MEASURED, chosen):
    rounds += 1
  entry = table(peak)["sharegpt"]["steady"]["5x"]["kv"]
  assert rounds == 3 and entry["best_knob"] == "0.7" and not entry["best_at_edge"]
  # The token-weighted optimum elsewhere (0.05): the sweep extends both ways.
  chosen = {key: list(first)}
  low = lambda w: -abs(w - 0.05)
  while line_study.extensions(table(peak, low), MEASURED, chosen):
    pass
  entry = table(peak, low)["sharegpt"]["steady"]["5x"]["kv"]
  assert entry["best_knob"] == "0.7" and entry["best_tokens_knob"] == "0.05"
  assert sorted(kv[i] for i in chosen[key]) == kv[1:12]  # each optimum and one past it
  # Rising to the ladder's end: nothing left to add, and the optimum is not bracketed.
  chosen = {key: [10, 11, 12]}
  assert line_study.extensions(table(lambda w: w), MEASURED, chosen) == 0
  assert table(lambda w: w)["sharegpt"]["steady"]["5x"]["kv"]["best_at_edge"]
