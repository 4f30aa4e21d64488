"""The studies' simulated deployments: each runs the studies' code, on its own device,
step rates and SLOs, and says so in the premises."""

import dataclasses
import pathlib
import subprocess
import sys

import pytest

from experiments import prefill_study, sim_setups

ROOT = pathlib.Path(__file__).resolve().parents[1]

EXPECTED = {  # setup -> (device, where its step rates come from)
    "llama_13b_a100": ("a100_80gb", "template rates of a100_80gb"),
    "yi_34b_a100_pcie_tp2": ("a100_80gb_pcie", "a100_80gb_pcie.json"),
}


@pytest.mark.parametrize("name", sorted(sim_setups.SETUPS))
def test_the_chunked_prefill_study_runs_on_each_setup(name, tmp_path):
  setup = sim_setups.SETUPS[name]
  scale = dataclasses.replace(prefill_study.SCALES["smoke"], sim_requests=24, sim_rates=(2,))
  record = prefill_study.run(scale, tmp_path, ("sim",), show_progress=False, setup=setup)
  hardware = record["sim"]["premises"]["hardware"]
  device, rates_source = EXPECTED[name]
  assert record["sim"]["setup"] == name and hardware["name"] == device
  assert rates_source in hardware["step_rates_source"]
  # Its SLOs are measured on its own device: 2x the unloaded run's median TPOT.
  analysis = record["sim"]["analysis"]
  assert analysis["slos"]["tpot_p99_s"] == 2 * analysis["unloaded"]["unloaded_tpot_p50_s"]
  assert analysis["rates"] == [2 * setup.rate_scale]
  assert len(analysis["policies"]) == 5  # prefill-first and four chunk sizes, one budget


def test_the_admission_study_runs_on_the_setups_device():
  # In a subprocess: the study is imported on its own, as its CLI imports it. Its SLOs
  # are measured on the setup (admission_study.measure), not set in the base config.
  code = ("from experiments import admission_study, sim_setups\n"
          "setup = sim_setups.SETUPS['yi_34b_a100_pcie_tp2']\n"
          "config = admission_study.base(admission_study.SCALES['smoke'], setup)\n"
          "print(config.mesh.tensor_parallel, config.hardware == setup.get_config().hardware,"
          " config.bench.slo_tpot)")
  result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  assert result.stdout.split() == ["2", "True", "None"]  # the config's own device
