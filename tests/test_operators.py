"""Per-operator step costs: the fit on the A100 profiles, carrying rates to another device,
steps priced as sums of parts, the step-cost report and the optional step-time noise."""

import dataclasses
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from configs import hardware as hardware_lib
from configs import llama2_70b, yi_34b
from kvpage import build
from kvpage.sim import operators
from kvpage.sim.step_model import StepNoise, StepRates

ROOT = pathlib.Path(__file__).resolve().parents[1]
CALIBRATIONS = ROOT / "configs" / "calibrations"
A100 = hardware_lib.get_hardware("a100_80gb")
H100 = hardware_lib.get_hardware("h100_80gb")
PROFILES = operators.read_profiles(CALIBRATIONS / "vidur" / "a100_mlp.csv")
SHIPPED = operators.load(CALIBRATIONS / "a100_80gb_operators.json")


def test_one_set_of_rates_predicts_a_model_it_was_not_fitted_on():
  """Leave one model out: fit on three, the fourth's per-layer non-attention time within
  10% median and 20% at the 90th percentile, over its token counts (1 to 4,096, or
  32,768) and tensor-parallel degrees (1 to 8). On a slice: every other token count."""
  rows = [row for row in PROFILES if row.tokens % 16 == 0 or row.tokens < 16]
  table = operators.leave_one_out(rows, measured_on=operators.Datasheet.of(A100),
                                  network="nvswitch")
  assert sorted(row["model"] for row in table) == [
      "llama2_70b", "llama2_7b", "llama3_70b", "llama3_8b"]
  for row in table:
    assert row["median"] < 0.10 and row["p90"] < 0.20, row


def test_the_shipped_operator_rates_are_the_fit_of_the_shipped_profiles():
  fitted = operators.fit(PROFILES, operators.read_allreduce(CALIBRATIONS / "vidur" /
                                                            "a100_all_reduce.csv"),
                         measured_on=operators.Datasheet.of(A100), network="nvswitch",
                         source=SHIPPED.source)
  for name in ("gemm_bandwidth", "gemm_peak_fraction", "gemm_half_tokens",
               "elementwise_bandwidth"):
    assert getattr(fitted, name) == pytest.approx(getattr(SHIPPED, name), rel=1e-4), name
  # A layer pays both floors on every profiled row, so the data pin their sum, not the
  # split between them (it moves by about 1% between scipy releases): the two floors
  # agree loosely, and every row is priced the same to a part in a million.
  for name in ("gemm_floor_s", "elementwise_floor_s"):
    assert getattr(fitted, name) == pytest.approx(getattr(SHIPPED, name), rel=0.05), name
  np.testing.assert_allclose(operators.layer_errors(fitted, PROFILES) + 1.0,
                             operators.layer_errors(SHIPPED, PROFILES) + 1.0, rtol=1e-6)
  assert fitted.allreduce.keys() == SHIPPED.allreduce.keys() == {"nvswitch", "nvlink_pairs"}
  assert sorted(SHIPPED.allreduce["nvswitch"]) == [2, 4, 8]
  # A GEMM reads its weights once: few tokens cost the weights, many tokens the FLOPs.
  big = operators.Operator("gemm", 1, 28672, 8192)
  for tokens in (1, 32):
    memory, compute = SHIPPED.gemm_bounds(dataclasses.replace(big, tokens=tokens), 2)
    assert memory > compute, tokens
  memory, compute = SHIPPED.gemm_bounds(dataclasses.replace(big, tokens=4096), 2)
  assert compute > 10 * memory
  assert 0.6 < SHIPPED.efficiency(4096) <= SHIPPED.gemm_peak_fraction < 0.9


def test_rates_carry_to_another_device_by_the_datasheets():
  carried = SHIPPED.carried_to(H100)
  assert carried.measured_on.name == "h100_80gb" and carried.network == H100.network
  assert carried.gemm_floor_s == SHIPPED.gemm_floor_s  # floors and the curve carry over
  assert carried.gemm_half_tokens == SHIPPED.gemm_half_tokens
  assert carried.gemm_bandwidth == pytest.approx(SHIPPED.gemm_bandwidth * 3350 / 2039)
  big = operators.Operator("gemm", 4096, 28672, 8192)
  assert carried.gemm_bounds(big, 2)[1] == pytest.approx(
      SHIPPED.gemm_bounds(big, 2)[1] * 312 / 989.4)
  assert carried.allreduce["nvswitch"][4].bandwidth == pytest.approx(
      SHIPPED.allreduce["nvswitch"][4].bandwidth * 1.5)
  assert carried.allreduce["nvswitch"][4].latency_s == SHIPPED.allreduce["nvswitch"][4].latency_s
  # The hardware entries without a calibration of their own are priced by the A100's.
  rates, source = build.step_rates(H100, calibrations=hardware_lib.CALIBRATIONS)
  assert rates.operators is not None and rates.measured_on.name == "h100_80gb"
  assert "carried to h100_80gb" in source


def test_operator_rates_refuse_bad_records():
  values = SHIPPED.to_dict()
  assert operators.OperatorRates.from_dict(values) == SHIPPED
  with pytest.raises(ValueError, match="unknown keys \\['extra'\\]"):
    operators.OperatorRates.from_dict(dict(values, extra=1))
  with pytest.raises(ValueError, match="gemm_peak_fraction must be in"):
    operators.OperatorRates.from_dict(dict(values, gemm_peak_fraction=1.5))
  with pytest.raises(ValueError, match="exactly one of"):
    dataclasses.replace(StepRates.template(A100), operators=SHIPPED)


def yi_model():
  hardware = hardware_lib.get_hardware("a100_80gb_pcie")
  rates, _ = build.step_rates(hardware, calibrations=hardware_lib.CALIBRATIONS)
  return build.step_model(yi_34b.get_config(), rates, hardware)


def test_a_mixed_step_is_the_sum_of_its_parts_at_its_total_token_count():
  model = yi_model()
  prompt = model.step_cost([(500, 500)], num_sampled=1)
  mixed = model.step_cost([(500, 500)] + [(1, 700)] * 12)
  # One launch, one pass over the weights for all 512 tokens: not a prompt step plus a
  # decode step.
  assert mixed.parts["launch"] == prompt.parts["launch"] == model.rates.launch_s
  # The A100 PCIe fit finds no launch cost of a prompt's own (NNLS: zero to rounding).
  assert mixed.parts["prefill_launch"] == model.rates.prefill_launch_s < 1e-9
  layer = sum(model.layer_parts(512).values())
  steps = sum(model.step_operator_parts(512, 13).values())
  assert mixed.parts["non_attention"] == pytest.approx(60 * layer + steps)
  alone = model.step_cost([(1, 700)] * 12)
  assert mixed.seconds < prompt.seconds + alone.seconds - model.rates.launch_s
  # The named parts add up to the total.
  named = model.named_parts(mixed)
  assert named["total_s"] == pytest.approx(
      named["launch_s"] + named["sequences_s"] + named["step_operators_s"] + named["swap_s"]
      + 60 * (named["non_attention_layer_s"] + named["all_reduce_layer_s"]
              + named["attention_layer_s"]))


def test_chunked_prefill_costs_its_launches_and_the_curve_nothing_else():
  """A prompt in chunks computes the same attention pairs; beyond one launch per chunk,
  it pays only for running its GEMMs at fewer rows, lower on the efficiency curve."""
  model = yi_model()
  whole = model.step_cost([(4096, 4096)])
  chunks = [model.step_cost([(1024, 1024 * (i + 1))], num_sampled=int(i == 3))
            for i in range(4)]
  assert sum(c.parts["prefill_attention"] for c in chunks) == pytest.approx(
      whole.parts["prefill_attention"])
  extra = sum(c.seconds for c in chunks) - whole.seconds
  launches = 3 * model.rates.launch_s
  assert extra > launches
  rates = model.rates.operators
  curve = sum(c.parts["non_attention"] for c in chunks) - whole.parts["non_attention"]
  assert curve > 0 and rates.efficiency(1024) < rates.efficiency(4096)
  assert extra == pytest.approx(launches + curve + sum(
      c.parts["allreduce"] for c in chunks) - whole.parts["allreduce"])


def test_noise_draws_the_recorded_residuals_reproducibly():
  quantiles = (0.9, 1.0, 1.0, 1.1, 2.0)
  draws = [StepNoise(quantiles, seed=3).factor() for _ in range(2)]
  assert draws[0] == draws[1]
  noise = StepNoise(quantiles, seed=3)
  factors = np.array([noise.factor() for _ in range(20000)])
  assert factors.min() >= 0.9 and factors.max() <= 2.0
  # The mean of the piecewise-linear inverse CDF: the trapezoid rule over its levels.
  assert factors.mean() == pytest.approx(np.trapezoid(quantiles, dx=1 / 4), rel=0.02)
  with pytest.raises(ValueError, match="noise quantiles"):
    StepNoise((), seed=0)
  with pytest.raises(ValueError, match="increasing order"):
    dataclasses.replace(StepRates.template(A100), noise_quantiles=(1.2, 1.0))


def run(module: str, *argv: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", module, *argv], cwd=ROOT, capture_output=True,
                        text=True, timeout=300)


def test_the_step_cost_report_names_each_part_and_its_premises():
  result = run("experiments.step_cost", "--config=configs/llama2_70b.py",
               "--hardware=h100_80gb", "--tensor_parallel=4", "--num_tokens=512",
               "--num_decode=64", "--context=900", "--json")
  assert result.returncode == 0, result.stderr
  record = json.loads(result.stdout)
  for key in ("non_attention_layer_s", "all_reduce_layer_s", "attention_layer_s", "launch_s",
              "total_s"):
    assert record[key] > 0, key
  premises = record["premises"]
  assert (premises["model"], premises["dtype"], premises["hardware"],
          premises["tensor_parallel"]) == ("llama2_70b", "fp16", "h100_80gb", 4)
  assert "a100_80gb_pcie.json" in premises["calibration"]
  assert sum(record["layer_operators_s"].values()) == pytest.approx(
      record["non_attention_layer_s"])
  layers = llama2_70b.get_config().model.num_layers
  assert record["total_s"] == pytest.approx(
      record["launch_s"] + record["sequences_s"] + record["step_operators_s"]
      + layers * (record["non_attention_layer_s"] + record["all_reduce_layer_s"]
                  + record["attention_layer_s"]))
  bad = run("experiments.step_cost", "--num_tokens=8", "--num_decode=9")
  assert bad.returncode != 0 and "Traceback" not in bad.stderr
  assert "--num_decode=9 is more than --num_tokens=8" in bad.stderr


def test_a_simulated_run_records_each_steps_parts_and_noise_changes_only_the_times(tmp_path):
  def bench(name: str, *extra: str) -> list[dict]:
    result = run("experiments.serve_bench", "--config=configs/yi_34b.py", "--executor=sim",
                 "--num_requests=20", "--arrival_rate=2", "--prompt_len=uniform:100:3000",
                 "--output_len=uniform:8:64", f"--workdir={tmp_path / name}", *extra)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (tmp_path / name / "steps.jsonl").read_text()
            .splitlines()]
    # A step that scheduled nothing (an aborted request's last) ran nothing and has no price.
    assert all(("parts" in row) == (row["num_seqs"] > 0) for row in rows)
    return [row for row in rows if row["num_seqs"]]

  plain, noisy = bench("plain"), bench("noisy", "--sim_noise")
  for row in plain:
    assert row["parts"]["total_s"] == pytest.approx(row["step_s"], rel=1e-9)
    assert "noise_s" not in row["parts"]
  assert all(row["parts"]["total_s"] == pytest.approx(row["step_s"]) for row in noisy)
  assert any(abs(row["parts"]["noise_s"]) > 0 for row in noisy)
  summary = json.loads((tmp_path / "noisy" / "summary.json").read_text())
  assert summary["premises"]["hardware"]["step_noise"] is True
