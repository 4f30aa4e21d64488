"""Mistral-7B (GQA 32:8) in bf16 on an 80 GB A100: a published serving setup's model.

Usage: `--config=configs/mistral_7b.py` (bf16) or `--config=configs/mistral_7b.py:fp8` (any dtype
as the variant); `--config.mesh.tensor_parallel=N` (or `--tensor_parallel=N`) to
change the device count.
"""

import ml_collections

from configs import base


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return base.build("mistral_7b", "bf16", arg, hardware="a100_80gb", tensor_parallel=1)
