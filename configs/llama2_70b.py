"""Llama-2-70B in fp16, tensor parallel 4 on 80 GB A100s (140 GB of weights fit no
single device; 4 is the degree vLLM's and Sarathi-Serve's 70B runs use).

Usage: `--config=configs/llama2_70b.py` (fp16) or `--config=configs/llama2_70b.py:fp8` (any dtype
as the variant); `--config.mesh.tensor_parallel=N` (or `--tensor_parallel=N`) to
change the device count.
"""

import ml_collections

from configs import base


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return base.build("llama2_70b", "fp16", arg, hardware="a100_80gb", tensor_parallel=4)
