"""The tiny config as the engine tests run it: two layers instead of four.

The layers are one piece of code repeated, so two of them test what four do (layer 0
and a later layer sharing one cache), while each step program compiles about a third
faster and runs twice as fast. Tests that pin the tiny model's own numbers, and the
HF parity checks (their own checkpoints), keep their models.
"""

import ml_collections

from configs import scheduler as scheduler_lib
from configs import tiny
from kvpage import build
from kvpage.host.engine import Engine
from kvpage.request import SamplingParams
from models import llama

NUM_LAYERS = 2


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = tiny.get_config(arg)
  config.model.num_layers = NUM_LAYERS
  return config



def mixed_step_engine(chunk_size: int = 8, num_pages: int = 32, **model_fields) -> Engine:
  """A real engine over this config's model (seed 3) with `model_fields` set on it (e.g.
  an implementation), in mixed steps: chunks of `chunk_size` prompt tokens beside
  decodes, `num_pages` pages of 4."""
  model = get_config().model
  model.update(model_fields)
  scheduler_config = scheduler_lib.get_scheduler_config()
  scheduler_config.chunk_size = chunk_size
  return build.jax_engine(llama, model, llama.random_init(model, seed=3), scheduler_config,
                          num_pages=num_pages, page_size=4)


def greedy_tokens(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
  """Each prompt's `max_tokens` greedy tokens from `engine`, all prompts at once."""
  done = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
  return [request.output_ids for request in done]
