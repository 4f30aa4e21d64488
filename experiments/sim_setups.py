"""The simulated deployments the studies run on, each with the latency SLOs it is judged by.

  * `llama_13b_a100`: Llama-2-13B fp16 on one A100-80GB SXM, priced by the entry's
    template rates (datasheet peaks x template efficiencies). The reference setup.
  * `yi_34b_a100_pcie_tp2`: Yi-34B fp16, tensor parallel 2 on two A100-80GB PCIe,
    priced by the calibration fit on Sarathi-Serve's published step profiles of that very
    deployment (`configs/calibrations/a100_80gb_pcie.json`): Sarathi-Serve's own setup,
    and the one setup whose step times are fit to measurements.

The SLOs scale with the device's unloaded decode step (batch 1, 1,024 tokens of context:
17.3 ms for the 13B setup, 46.2 ms for Yi-34B): a strict TPOT p99 of about 2x it, an ITL
p99 (Sarathi's time-between-tokens) of about 5-6x, and the admission study's goodput
TPOT of about 3x. Arrival rates are the studies' own (written for the 13B setup) times
`rate_scale`, so that each setup's sweep reaches past its saturation.
"""

import dataclasses
from collections.abc import Callable

import ml_collections
from absl import flags

from configs import llama_13b, yi_34b


@dataclasses.dataclass(frozen=True)
class SimSetup:
  """A simulated deployment: its config, device, rate scale and SLOs."""

  name: str
  get_config: Callable[[], ml_collections.ConfigDict]
  hardware: str | None  # None: the config's own entry (and the calibration it names)
  rate_scale: float
  tpot_slo_s: float  # strict TPOT p99 (the chunked-prefill study's capacity)
  itl_slo_s: float  # ITL p99
  goodput_tpot_slo_s: float  # the admission study's goodput


SETUPS = {
    "llama_13b_a100": SimSetup("llama_13b_a100", llama_13b.get_config, "a100_80gb",
                               rate_scale=1.0, tpot_slo_s=0.035, itl_slo_s=0.1,
                               goodput_tpot_slo_s=0.05),
    "yi_34b_a100_pcie_tp2": SimSetup("yi_34b_a100_pcie_tp2", yi_34b.get_config, None,
                                     rate_scale=0.25, tpot_slo_s=0.1, itl_slo_s=0.25,
                                     goodput_tpot_slo_s=0.15),
}
DEFAULT = "llama_13b_a100"

# The studies' two shared flags, defined once here so that any of them may be imported
# beside another (a test, a notebook).
SCALE = flags.DEFINE_enum("scale", "full", ["smoke", "full"],
                          "The study's size: smoke = about a minute (CI); full = its figures.")
SETUP = flags.DEFINE_enum("sim_setup", DEFAULT, list(SETUPS),
                          "The simulated deployment (experiments/sim_setups.py).")
