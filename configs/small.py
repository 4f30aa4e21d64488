"""A 25M-parameter Llama (8 layers, d_model 512, GQA 8:2) for CPU throughput work.

Big enough that compute, not host overhead, sets a step's time on a 2-core CPU, small
enough to serve 32 sequences of 2,048 tokens there. Its KV pool is the default byte
budget (`cache.kv_memory_gib`), not a page count.

Usage: `--config=configs/small.py` (fp32) or `--config=configs/small.py:bf16`.
"""

import ml_collections

from configs import base


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = base.build("small", "fp32", arg, hardware="cpu")
  config.scheduler.max_num_seqs = 64
  return config
