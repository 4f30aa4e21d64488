"""A long-context step's scratch memory grows with the pages it touches, not tokens x context.

The compiled step's temporary memory (`Step.temp_bytes`, XLA's buffer assignment) is read
at two page-table widths, 1,024 and 2,048 tokens of context, for the shapes of a decode
step of 32 sequences and of a mixed step (512 tokens, e.g. a prompt chunk beside 31
decodes); the analysis is static, so shapes are all it reads. Doubling
the context may add at most what the extra pages hold (one gather of them), never a
per-token copy of the context: that would cost 512 x 1,024 tokens of K and V per
layer, 16x more. (The XLA path folds key tiles: a decode step holds ~2.3 MB at 1,024
and at 2,048, the mixed step ~5.8 MB.)
"""

import functools

import jax
import pytest

from configs import tiny
from kvpage import batch as batch_lib
from kvpage.device import cache as paged_cache
from kvpage.device import step as step_lib
from models import llama

MODEL = tiny.get_config().model.copy_and_resolve_references()
MODEL.num_layers = 2  # what one layer needs shows as well; half the compile time
PAGE_SIZE = 16
NUM_SEQS = 32


def temp_bytes(context: int, num_tokens: int, decode_only: bool) -> int:
  width = context // PAGE_SIZE
  num_pages = 1 + NUM_SEQS * width
  params = llama.random_init(MODEL, seed=0)
  cache = jax.eval_shape(functools.partial(paged_cache.init, MODEL, num_pages=num_pages,
                                           page_size=PAGE_SIZE))
  step = step_lib.Step(functools.partial(llama.forward, config=MODEL))
  batch = batch_lib.example_batch(num_tokens, NUM_SEQS, width, decode_only=decode_only)
  return step.temp_bytes(params, cache, batch, all_greedy=True)


def kv_bytes(tokens: int) -> int:
  """K and V of `tokens` tokens in one layer."""
  return 2 * 4 * MODEL.num_kv_heads * MODEL.head_dim * tokens


@pytest.mark.parametrize("num_tokens,decode_only", [(NUM_SEQS, True), (512, False)])
def test_scratch_grows_with_pages_touched(num_tokens, decode_only):
  short, long = (temp_bytes(context, num_tokens, decode_only) for context in (1024, 2048))
  extra_pages = kv_bytes(NUM_SEQS * 1024)  # what the wider tables add, one layer
  per_token_copies = kv_bytes(512 * 1024)  # a copy of the added context per chunk token
  assert long - short <= extra_pages, (short, long, extra_pages)  # at most one gather more
  assert long - short < per_token_copies / 16
  assert long <= 2 * kv_bytes(NUM_SEQS * 2048)  # the whole step: two gathers' worth at most
