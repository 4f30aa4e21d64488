"""Llama-3-70B in bf16, tensor parallel 4 on 80 GB H100s.

Usage: `--config=configs/llama3_70b.py` (bf16) or `--config=configs/llama3_70b.py:fp8` (any dtype
as the variant); `--config.mesh.tensor_parallel=N` (or `--tensor_parallel=N`) to
change the device count.
"""

import ml_collections

from configs import base


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return base.build("llama3_70b", "bf16", arg, hardware="h100_80gb", tensor_parallel=4)
