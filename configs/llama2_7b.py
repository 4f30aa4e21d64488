"""Llama-2-7B in fp16 on one 80 GB A100 (one of the four models of the per-operator A100
profiles the simulator's operator rates are fitted on, `configs/calibrations/vidur/`).

Usage: `--config=configs/llama2_7b.py` (fp16) or `--config=configs/llama2_7b.py:bf16` (any
dtype as the variant); `--tensor_parallel=N` to split it.
"""

import ml_collections

from configs import base


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return base.build("llama2_7b", "fp16", arg, hardware="a100_80gb", tensor_parallel=1)
