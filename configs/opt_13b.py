"""OPT-13B in fp16 on an 80 GB A100 (MHA, learned positions): the model of vLLM's
PagedAttention paper (SOSP'23). Shapes only: the simulator and the capacity model
run it; the JAX model (Llama's) does not.

Usage: `--config=configs/opt_13b.py` (fp16) or `--config=configs/opt_13b.py:fp8` (any dtype
as the variant); `--config.mesh.tensor_parallel=N` (or `--tensor_parallel=N`) to
change the device count.
"""

import ml_collections

from configs import base


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return base.build("opt_13b", "fp16", arg, hardware="a100_80gb", tensor_parallel=1)
