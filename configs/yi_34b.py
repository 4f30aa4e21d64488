"""Yi-34B in fp16, tensor parallel 2 on two 80 GB A100 PCIe: Sarathi-Serve's setup
(OSDI'24), whose published step profile calibrates `a100_80gb_pcie`.

Usage: `--config=configs/yi_34b.py` (fp16) or `--config=configs/yi_34b.py:fp8` (any dtype
as the variant); `--config.mesh.tensor_parallel=N` (or `--tensor_parallel=N`) to
change the device count.
"""

import ml_collections

from configs import base


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return base.build("yi_34b", "fp16", arg, hardware="a100_80gb_pcie", tensor_parallel=2)
