"""A grouped-query-attention example: Llama-3-8B in bf16 (32 heads share 8 KV heads).

Usage: `--config=configs/llama3_8b.py` or `--config=configs/llama3_8b.py:fp8`.
"""

import ml_collections

from configs import base


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return base.build("llama3_8b", "bf16", arg, hardware="h100_80gb")
