"""The simulator's step-cost model and its calibration: parts, fitting, shipped files."""

import dataclasses
import json
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from configs import hardware as hardware_lib
from configs import llama_13b, yi_34b
from kvpage import build, metrics, model_shape, sizing
from kvpage.sim import calibration, capacity, operators, step_model
from kvpage.sim.step_model import RegimeRates, StepModel, StepRates

ROOT = pathlib.Path(__file__).resolve().parents[1]
A100 = hardware_lib.get_hardware("a100_80gb")
LLAMA_13B = model_shape.ModelShape.from_config(llama_13b.get_config().model)
CALIBRATIONS = ROOT / "configs" / "calibrations"
PROFILES = CALIBRATIONS / "sarathi-serve"


def template_model(model=LLAMA_13B, hardware=A100, **kwargs) -> StepModel:
  return StepModel(model, StepRates.template(hardware), weight_dtype="fp16", **kwargs)


def test_template_prices_prefill_by_compute_and_decode_by_bandwidth():
  model = template_model()
  prefill = model.step_cost([(2048, 2048)])
  decode = model.step_cost([(1, 1024)] * 32)
  assert prefill.linear_bound == "compute" and decode.linear_bound == "memory"
  # Decode at batch 1: the weights (less the input embedding table, a gather of one
  # row) and one token's keys and values, over 2,039 GB/s x 0.8, plus the 1 ms launch.
  single = model.step_cost([(1, 1)])
  weights_read = 26_031_728_640 - 32000 * 5120 * 2 + 5120 * 2
  bandwidth = 2_039e9 * 0.8
  assert math.isclose(single.parts["non_attention"], weights_read / bandwidth, rel_tol=1e-9)
  assert math.isclose(single.parts["decode_attention"], 819_200 / bandwidth, rel_tol=1e-9)
  assert single.seconds == pytest.approx(single.parts["non_attention"] + single.parts[
      "decode_attention"] + A100.step_overhead_s)
  # Prefill FLOPs: 2 x decoder-layer params per token, the LM head for one row only.
  layer_params = 13_015_864_320 - 2 * 32000 * 5120
  assert prefill.work.linear_flops == 2 * layer_params * 2048 + 2 * 32000 * 5120
  assert prefill.work.prefill_attention_flops == 4 * 40 * 40 * 128 * 2048 * 2049 // 2


def test_chunks_pay_for_re_reading_the_prompt_so_far():
  model = template_model()
  whole = model.step_cost([(2048, 2048)]).parts["prefill_attention"]
  chunks = [model.step_cost([(512, 512 * (i + 1))]).parts["prefill_attention"]
            for i in range(4)]
  assert chunks == sorted(chunks) and chunks[0] < chunks[-1]  # later chunks see more keys
  assert math.isclose(sum(chunks), whole)  # the same pairs, over four launches
  four_launches = sum(model.step_cost([(512, 512 * (i + 1))]).seconds for i in range(4))
  assert four_launches > model.step_cost([(2048, 2048)]).seconds


def test_tensor_parallel_splits_the_work_and_prices_two_all_reduces_a_layer():
  one, two = template_model(), template_model(tensor_parallel=2)
  step = [(1, 1024)] * 8
  a, b = one.step_cost(step), two.step_cost(step)
  assert b.work.linear_flops == pytest.approx(a.work.linear_flops / 2)
  assert b.work.decode_kv_bytes == pytest.approx(a.work.decode_kv_bytes / 2)
  assert a.parts["allreduce"] == 0 and b.work.num_allreduces == 2 * 40
  ring = 2 * (2 - 1) / 2 * 8 * 5120 * 2  # each all-reduce's bytes per device
  assert b.parts["allreduce"] == pytest.approx(80 * (2e-5 + ring / 300e9))
  # Fewer KV heads than devices: each device keeps one (replicated), not a fraction.
  gqa = dataclasses.replace(LLAMA_13B, num_kv_heads=2)
  assert model_shape.kv_heads_per_device(gqa, 4) == 1
  assert (model_shape.kv_bytes_per_token(gqa, "fp16", 4)
          == model_shape.kv_bytes_per_token(gqa, "fp16", 2))


@pytest.mark.parametrize("model,tp,message", [
    (LLAMA_13B, 3, "num_heads=40 does not split"),
    (dataclasses.replace(LLAMA_13B, num_heads=48, num_kv_heads=6, ffn_dim=13824), 4,
     "num_kv_heads=6 neither splits"),
    (LLAMA_13B, 0, "tensor_parallel must be a positive"),
])
def test_shapes_that_cannot_split_are_refused(model, tp, message):
  with pytest.raises(ValueError, match=message):
    model_shape.check_tensor_parallel(model, tp)


def test_capacity_is_per_device_over_a_tensor_parallel_group():
  yi = model_shape.ModelShape.from_config(yi_34b.get_config().model)
  one = capacity.plan(yi, seq_len=4096, memory_bytes=A100.memory_bytes, weight_dtype="fp16")
  two = capacity.plan(yi, seq_len=4096, memory_bytes=A100.memory_bytes, weight_dtype="fp16",
                      tensor_parallel=2)
  assert two.weight_bytes == -(-one.weight_bytes // 2)
  assert two.kv_bytes_per_token == one.kv_bytes_per_token // 2
  assert two.max_concurrent_requests > 2 * one.max_concurrent_requests  # weights shrink too


KNOWN = StepRates(launch_s=2e-3, per_sequence_s=5e-5,
                  regimes=RegimeRates(knee_tokens=128, small_flops=40e12,
                                      small_bandwidth=1.2e12, large_flops=150e12,
                                      large_bandwidth=1.0e12),
                  prefill_attention_flops=60e12, decode_attention_bandwidth=0.4e12,
                  allreduce_latency_s=2e-5, link_bandwidth=300e9, source="test",
                  prefill_launch_s=4e-3, idle_launch_s=3e-3)


def synthetic_samples(model: StepModel, seed: int) -> list[calibration.Sample]:
  """Decode batches at varied contexts, prefills, chunks over a prefix, mixed steps;
  every seventh launched after the device idled."""
  rng = np.random.default_rng(seed)
  steps = []
  for _ in range(60):
    batch = int(rng.integers(1, 200))
    steps.append([(1, int(c)) for c in rng.integers(16, 4000, batch)])
  for tokens in (16, 32, 64, 96, 200, 512, 1024, 2048, 4096):
    steps.append([(tokens, tokens)])
    steps.append([(tokens, tokens + int(rng.integers(1, 3000)))])
  for _ in range(20):
    steps.append([(int(rng.integers(64, 1024)), 2048)] + [(1, int(c)) for c in
                                                        rng.integers(16, 2000, 30)])
  works = [model.work(s, after_idle=i % 7 == 3) for i, s in enumerate(steps)]
  return [calibration.Sample(work, model.price(work).seconds) for work in works]


@pytest.mark.parametrize("loss", calibration.LOSSES)
@pytest.mark.parametrize("weighting", calibration.WEIGHTINGS)
def test_the_fit_recovers_known_rates_from_synthetic_step_times(weighting, loss):
  model = StepModel(LLAMA_13B, KNOWN, weight_dtype="fp16", tensor_parallel=2)
  result = calibration.fit(synthetic_samples(model, 0), model, A100, weighting=weighting,
                           knee_tokens=128, tie_decode_attention=False, loss=loss)
  assert result.not_identified == ()
  for field in ("launch_s", "prefill_launch_s", "idle_launch_s", "per_sequence_s",
                "prefill_attention_flops", "decode_attention_bandwidth"):
    assert getattr(result.rates, field) == pytest.approx(getattr(KNOWN, field), rel=1e-3), field
  for field in ("small_flops", "small_bandwidth", "large_flops", "large_bandwidth"):
    assert getattr(result.rates.regimes, field) == pytest.approx(
        getattr(KNOWN.regimes, field), rel=1e-3), field
  assert result.rms_relative_error < 1e-6


def test_the_absolute_loss_prices_the_typical_step_not_the_tail():
  """Step times on a shared CPU have a long tail: one step in five here is 3x slower. A
  least-squares fit prices decode steps at their mean; least absolute deviations at
  their median, which is what the simulator's median step is judged against."""
  model = StepModel(LLAMA_13B, KNOWN, weight_dtype="fp16")
  clean = synthetic_samples(model, 2)
  noisy = [calibration.Sample(s.work, s.seconds * (3.0 if i % 5 == 0 else 1.0))
           for i, s in enumerate(clean)]
  decodes = [i for i, s in enumerate(clean) if calibration.step_kind(s.work) == "decode"
             and i % 5]
  for loss, tolerance in (("absolute", 0.02), ("squares", None)):
    result = calibration.fit(noisy, model, A100, knee_tokens=128, tie_decode_attention=False,
                             loss=loss)
    priced = model.with_rates(result.rates)
    errors = [priced.price(clean[i].work).seconds / clean[i].seconds - 1 for i in decodes]
    if tolerance is not None:
      assert np.median(np.abs(errors)) < tolerance
    else:  # the tail pulls the mean fit well above the typical step
      assert np.median(errors) > 0.1


def test_by_kind_weighs_each_kind_of_step_alike():
  model = StepModel(LLAMA_13B, KNOWN, weight_dtype="fp16")
  samples = synthetic_samples(model, 1)
  works = [s.work for s in samples]
  kinds = [calibration.step_kind(w) for w in works]
  assert (kinds.count("decode"), kinds.count("prefill"), kinds.count("mixed")) == (60, 18, 20)
  weights = calibration._weights("by_kind", works, np.array([s.seconds for s in samples]))
  for kind in ("decode", "prefill", "mixed"):  # squared factors: each kind sums to one
    assert sum(w * w for w, k in zip(weights, kinds, strict=True) if k == kind) == (
        pytest.approx(1.0))


def test_the_fit_ties_decode_attention_when_every_decode_sees_one_context():
  model = StepModel(LLAMA_13B, KNOWN, weight_dtype="fp16")
  samples = [calibration.Sample(model.work(s), model.step_cost(s).seconds)
             for s in ([(1, 1000)] * b for b in (1, 2, 4, 8, 16, 32))]
  samples += [calibration.Sample(model.work([(t, t)]), model.step_cost([(t, t)]).seconds)
              for t in (256, 1024, 4096)]
  assert calibration.decode_spread(samples) == 0.0
  result = calibration.fit(samples, model, A100)
  assert result.tied_decode_attention
  assert result.rates.decode_attention_bandwidth == result.rates.regimes.small_bandwidth


def profile_fit() -> tuple[calibration.Fit, list[dict]]:
  """The shipped a100_80gb_pcie calibration, refit from the published profiles on top
  of the shipped operator rates (the command in experiments/calibrate.py)."""
  config = yi_34b.get_config()
  hardware = hardware_lib.get_hardware("a100_80gb_pcie")
  rates = dataclasses.replace(StepRates.template(hardware), regimes=None, operators=(
      operators.load(CALIBRATIONS / "a100_80gb_operators.json").carried_to(hardware)))
  model = build.step_model(config, rates, hardware)
  samples = [sample for name in ("decode", "prefill") for sample in calibration.profile_samples(
      PROFILES / f"yi34b_tp2_a100_80gb_pcie_{name}.csv", model, 1020)]
  train, held = calibration.split_held_out(samples, max_decode_batch=32,
                                           max_prefill_tokens=4096)
  result = calibration.fit(train, model, hardware, loss="absolute")
  priced = model.with_rates(result.rates)
  return result, calibration.points(train, priced, "train") + calibration.points(
      held, priced, "held-out")


def test_the_shipped_a100_pcie_calibration_extrapolates():
  """Fit on decode batches <= 32 and prefills <= 4,096 tokens only, with the operator
  rates pricing the linear work, it predicts the published decode batch 64 and
  prefills of 8,192 and 16,384 tokens within 15%, and fits its training steps better
  than the step-level fit did (16.8% RMS). Decode batch 128 is +19% (issue 40 keeps
  it open: the training decodes rise 1.3 ms a sequence, the published 64 -> 128 only
  0.96 ms)."""
  result, rows = profile_fit()
  held = [row for row in rows if row["split"] == "held-out"]
  assert [row["num_tokens"] for row in held] == [64, 128, 8192, 16384]
  assert all(abs(row["error"]) < 0.15 for row in held if row["num_tokens"] != 128), held
  assert abs(held[1]["error"]) < 0.2, held[1]
  assert result.rms_relative_error < 0.168
  assert result.rates.operators is not None and result.rates.prefill_launch_s < 1e-3
  shipped = calibration.load(CALIBRATIONS / "a100_80gb_pcie.json")
  assert StepRates.from_dict(shipped["rates"]).operators == result.rates.operators
  for key, value in result.rates.to_dict().items():  # reproducible
    if isinstance(value, float) or (isinstance(value, tuple) and value
                                    and isinstance(value[0], float)):
      assert shipped["rates"][key] == pytest.approx(
          list(value) if isinstance(value, tuple) else value, rel=1e-6), key
    elif key not in ("source", "operators"):
      assert shipped["rates"][key] == (list(value) if isinstance(value, tuple) else value), key


def test_a_simulated_runs_steps_calibrate_back_to_its_rates(tmp_path):
  """serve_bench's steps.jsonl records each step's time and work: fit on a simulated
  run, the calibration prices its steps as the simulator did."""
  run = subprocess.run(
      [sys.executable, "-m", "experiments.serve_bench", "--config=configs/llama_13b.py",
       "--executor=sim", "--num_requests=40", "--arrival_rate=4",
       "--prompt_len=uniform:16:2000", "--output_len=uniform:8:64", f"--workdir={tmp_path}/a"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr
  out = tmp_path / "cal.json"
  fit = subprocess.run(
      [sys.executable, "-m", "experiments.calibrate", "--config=configs/llama_13b.py",
       f"--steps={tmp_path}/a/steps.jsonl", f"--out={out}", "--json"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert fit.returncode == 0, fit.stderr
  record = json.loads(fit.stdout)
  assert record["premises"]["num_train"] > 100
  assert max(abs(row["error"]) for row in record["points"]) < 1e-3
  rates = calibration.load(out)["rates"]
  template = StepRates.template(A100)
  assert rates["regimes"]["large_flops"] == pytest.approx(template.regimes.large_flops, rel=1e-3)
  assert rates["regimes"]["small_bandwidth"] == pytest.approx(template.regimes.small_bandwidth,
                                                              rel=1e-3)
  assert rates["launch_s"] == pytest.approx(template.launch_s, rel=1e-2)


def test_padded_counts_pad_rows_and_tokens_as_the_engine_runs_them():
  decode = metrics.step_counts([(1, 100)] * 3)
  assert step_model.padded_counts(decode, 4, 4) == dict(decode, num_tokens=4, num_sequences=4,
                                                        num_sampled=4)
  mixed = metrics.step_counts([(40, 40), (1, 100)])
  assert step_model.padded_counts(mixed, 64, 64) == dict(mixed, num_tokens=64, num_sequences=64)
  # With the longest decode context, every row reads that far (kvpage's decode pass).
  ragged = [(1, 100), (1, 30), (1, 250)]
  longest = metrics.longest_decode(ragged)
  assert longest == 250 and metrics.longest_decode([(40, 40)]) == 0
  assert step_model.padded_counts(metrics.step_counts(ragged), 4, 4, longest)[
      "decode_context"] == 4 * 250
  assert step_model.padded_counts(mixed, 64, 64, 100)["decode_context"] == 64 * 100
  prompts_only = metrics.step_counts([(40, 40)])
  assert step_model.padded_counts(prompts_only, 64, 64, 0)["decode_context"] == 0
  with pytest.raises(ValueError, match="padded_work must be true or false"):
    StepRates.from_dict(dict(KNOWN.to_dict(), padded_work="yes"))
  with pytest.raises(ValueError, match="decode_reads_longest must be true or false"):
    StepRates.from_dict(dict(KNOWN.to_dict(), decode_reads_longest=1))


@pytest.mark.parametrize("reads_longest", [False, True])
def test_a_padded_calibration_prices_padded_steps_and_calibrates_back(tmp_path, reads_longest):
  """Rates fit on padded work (a kvpage run's steps) make the simulator pad its steps to
  the server's buckets; its steps.jsonl records the padded shapes (and, where decode rows
  read to the longest context, that context) and when each step's samples came back,
  and fitting them gives back rates that price every step as the simulator did, the
  steps launched after the device idled among them."""
  cpu = hardware_lib.get_hardware("cpu")
  rates = dataclasses.replace(StepRates.template(cpu), per_sequence_s=1e-4,
                              prefill_launch_s=1e-2, idle_launch_s=5e-3, padded_work=True,
                              decode_reads_longest=reads_longest)
  given = tmp_path / "given.json"
  given.write_text(json.dumps(dict(rates=rates.to_dict())))
  run = subprocess.run(
      [sys.executable, "-m", "experiments.serve_bench", "--config=configs/tiny.py",
       "--executor=sim", "--hardware=cpu", f"--calibration={given}", "--num_requests=40",
       "--arrival_rate=20", "--prompt_len=uniform:16:300", "--output_len=uniform:8:64",
       f"--workdir={tmp_path}/a"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr
  rows = [json.loads(line) for line in (tmp_path / "a" / "steps.jsonl").read_text().splitlines()]
  decodes = [row["work"] for row in rows if row["work"]["prefill_pairs"] == 0
             and row["work"]["num_sequences"] in (3, 5, 6, 7)]
  assert decodes and all(work["padded_sequences"] in (4, 8) for work in decodes)
  assert all(row["work"]["padded_tokens"] >= row["work"]["num_tokens"] for row in rows)
  assert all(("decode_longest" in row["work"]) == reads_longest for row in rows)
  idle = [row["parts"]["launch_s"] - rates.launch_s - (
      rates.prefill_launch_s if row["work"]["prefill_pairs"] else 0.0)
          for row in rows if row["work"]["num_tokens"]]
  assert any(abs(extra - 5e-3) < 1e-9 for extra in idle)  # after the device idled
  assert any(abs(extra) < 1e-9 for extra in idle)  # back to back
  fit = subprocess.run(
      [sys.executable, "-m", "experiments.calibrate", "--config=configs/tiny.py",
       "--hardware=cpu", f"--steps={tmp_path}/a/steps.jsonl", "--json"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert fit.returncode == 0, fit.stderr
  record = json.loads(fit.stdout)
  assert record["rates"]["padded_work"] is True
  assert record["rates"]["decode_reads_longest"] is reads_longest
  assert max(abs(row["error"]) for row in record["points"]) < 1e-3
  assert record["rates"]["prefill_launch_s"] == pytest.approx(1e-2, rel=1e-2)
  assert record["rates"]["idle_launch_s"] == pytest.approx(5e-3, rel=1e-2)


@pytest.mark.parametrize("argv,message", [
    ([], "give measured steps"),
    ([f"--profile={PROFILES}/yi34b_tp2_a100_80gb_pcie_decode.csv"], "give --profile_context"),
    (["--steps=/no/such.jsonl"], "cannot read it"),
])
def test_calibrate_bad_input_is_one_line(argv, message):
  result = subprocess.run([sys.executable, "-m", "experiments.calibrate",
                           "--config=configs/yi_34b.py", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
  assert result.returncode != 0 and "Traceback" not in result.stderr
  assert result.stderr.strip().splitlines()[-1].startswith("error: ")
  assert message in result.stderr


def test_the_real_path_refuses_what_only_the_simulator_can_run():
  from configs import opt_13b

  with pytest.raises(ValueError, match="simulator and the capacity model only"):
    sizing.check_runnable(opt_13b.get_config())
  # In this process JAX sees one device (tests/multi_device runs with more).
  with pytest.raises(ValueError, match=r"mesh\.tensor_parallel=2 needs 2 devices and JAX "
                                       r"sees 1; on CPU, XLA_FLAGS="):
    sizing.check_runnable(yi_34b.get_config())
  sizing.check_runnable(llama_13b.get_config())  # a Llama on one device runs


def test_the_capacity_report_is_per_device_under_tensor_parallel():
  def report(*flags):
    result = subprocess.run([sys.executable, "-m", "experiments.capacity",
                             "--config=configs/llama2_70b.py", "--json", *flags], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)

  four, eight = report(), report("--tensor_parallel=8")
  assert four["tensor_parallel"] == 4 and eight["tensor_parallel"] == 8
  assert eight["weight_bytes"] == pytest.approx(four["weight_bytes"] / 2, rel=1e-6)
  assert eight["kv_bytes_per_token"] == four["kv_bytes_per_token"] // 2
