"""The tiny config as the engine tests run it: two layers instead of four.

The layers are one piece of code repeated, so two of them test what four do (layer 0
and a later layer sharing one cache), while each step program compiles about a third
faster and runs twice as fast. Tests that pin the tiny model's own numbers, and the
HF parity checks (their own checkpoints), keep their models.
"""

import ml_collections

from configs import tiny

NUM_LAYERS = 2


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = tiny.get_config(arg)
  config.model.num_layers = NUM_LAYERS
  return config
