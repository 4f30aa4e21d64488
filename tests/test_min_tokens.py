"""`min_tokens`: a request's stop tokens are never sampled before it has that many
tokens (masked in the sampler, as vLLM does), greedy or sampled; after, they stop it."""

import pytest
from tiny_config import mixed_step_engine

from kvpage.request import SamplingParams

PROMPT = [5, 9, 13, 2, 7]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_stop_tokens_are_held_back_until_min_tokens(temperature):
  engine = mixed_step_engine()
  base = dict(max_tokens=8, temperature=temperature, seed=11)
  (free,) = engine.generate([PROMPT], SamplingParams(**base, ignore_eos=True))
  stops = tuple(dict.fromkeys(free.output_ids[:3]))  # tokens it samples early
  (held,) = engine.generate([PROMPT], SamplingParams(**base, stop_token_ids=stops,
                                                     min_tokens=4))
  assert not set(held.output_ids[:4]) & set(stops)  # never drawn before the fourth
  assert len(held.output_ids) == 8 or held.output_ids[-1] in stops
  if held.finish_reason == "stop":
    assert len(held.output_ids) > 4
  (early,) = engine.generate([PROMPT], SamplingParams(**base, stop_token_ids=stops))
  assert early.finish_reason == "stop" and len(early.output_ids) <= 3
