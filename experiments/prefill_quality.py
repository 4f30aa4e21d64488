"""Greedy generation with its logits, the prompt prefilled whole or in chunks.

The quality half of the chunked-prefill study (`experiments/prefill_study.py`): a
chunked prefill computes the same attention in pieces — each chunk reads the pages
the chunks before it wrote — so in exact arithmetic it changes nothing, and in
floating point it changes the order of sums. `greedy_with_logits` drives the real
scheduler and model step by step (one request, no sampling noise) and keeps the
logits of every generated position, so two chunk sizes can be compared position by
position.
"""

import dataclasses
import functools

import jax
import ml_collections
import numpy as np

from configs import scheduler as scheduler_defaults
from kvpage import batch as batch_lib
from kvpage import sizing
from kvpage.device import cache as paged_cache
from kvpage.host.scheduler import Scheduler
from kvpage.request import Request, SamplingParams
from models import llama


@dataclasses.dataclass(frozen=True)
class GreedyRun:
  prompt: tuple[int, ...]
  tokens: list[int]
  logits: np.ndarray  # f32[num_tokens, vocab]: the logits each token was chosen from
  num_prefill_steps: int


@functools.lru_cache(maxsize=8)
def _model(frozen: ml_collections.FrozenConfigDict, seed: int):
  return llama.random_init(frozen, seed), jax.jit(functools.partial(llama.forward,
                                                                    config=frozen))


def greedy_with_logits(model_config: ml_collections.ConfigDict, *, prompt_len: int,
                       num_tokens: int, chunk_size: int, seed: int = 0,
                       page_size: int = 16) -> GreedyRun:
  """`num_tokens` greedy tokens after a random prompt of `prompt_len` ids (seeded), the
  prompt prefilled whole (`chunk_size=0`, prefill-first) or `chunk_size` tokens a step;
  random weights of `seed`."""
  if prompt_len < 1 or num_tokens < 1 or chunk_size < 0:
    raise ValueError("prompt_len and num_tokens must be >= 1 and chunk_size >= 0, got "
                     f"{prompt_len}, {num_tokens}, {chunk_size}")
  frozen = ml_collections.FrozenConfigDict(model_config)
  params, forward = _model(frozen, seed)
  prompt = tuple(int(t) for t in np.random.default_rng(seed).integers(
      1, model_config.vocab_size, prompt_len))
  num_pages = -(-(prompt_len + num_tokens) // page_size) + 2
  max_len = sizing.max_model_len(model_config, num_pages=num_pages, page_size=page_size)
  if prompt_len + num_tokens > max_len:
    raise ValueError(f"a prompt of {prompt_len} and {num_tokens} tokens exceed the model's "
                     f"{model_config.max_seq_len} positions")
  config = scheduler_defaults.get_scheduler_config()
  config.prefill_policy = "chunked" if chunk_size else "none"
  config.chunk_size = chunk_size
  config.max_num_batched_tokens = max_len  # only the chunk size splits the prompt
  config.watermark = 0.0
  scheduler = Scheduler(config, num_pages=num_pages, page_size=page_size,
                        max_model_len=max_len, vocab_size=model_config.vocab_size)
  request = Request("q", list(prompt), SamplingParams(max_tokens=num_tokens, ignore_eos=True))
  if not scheduler.add_request(request).admitted:
    raise RuntimeError("the quality run's single request was not admitted")
  cache = paged_cache.init(frozen, num_pages=num_pages, page_size=page_size)
  tokens, logits, prefill_steps = [], [], 0
  while not request.is_finished:
    output = scheduler.schedule()
    (seq,) = output.scheduled
    prefill_steps += len(seq.token_ids) > 1 or not request.output_ids
    batch, _ = batch_lib.build(output.scheduled, page_size=page_size)
    step_logits, cache = forward(params, cache, batch)
    sampled = {}
    if seq.samples:
      row = np.asarray(step_logits[0], np.float32)
      tokens.append(int(row.argmax()))
      logits.append(row)
      sampled = {seq.request_id: tokens[-1]}
    scheduler.update(output, sampled)
  return GreedyRun(prompt, tokens, np.stack(logits), prefill_steps)
