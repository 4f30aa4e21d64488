"""The tiny Llama generates the same greedy tokens with the Pallas kernels as without.

The engine's jitted step picks attention by `config.model.attention_impl`; on CPU the
`pallas` choice runs the kernels in interpret mode. Chunked prefill (Sarathi-Serve)
exercises every path in one run: a first step of prompt chunks (ragged kernel), mixed
steps of a chunk beside other requests' decodes (ragged kernel), then decode-only
steps (decode kernel, chosen by `lax.cond` inside the jitted step).
Random weights make greedy tokens repetitive, so token equality alone is a weak check;
the test therefore also compares every attention call the model makes (every layer of
every real step, traced inside the jitted step) with the reference, through a
`jax.debug.callback`. Prompts are short and outputs few so this stays a CI-sized test.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_config
from jax.experimental.pallas import mosaic_gpu as plgpu

from configs import scheduler as scheduler_lib
from kvpage import build
from kvpage.device.attention import reference
from kvpage.device.backends.pallas import attention as paged_attention
from kvpage.device.backends.pallas import mosaic_decode
from kvpage.request import SamplingParams
from models import llama

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [7, 3], [42]]
NUM_NEW_TOKENS = 5


def greedy_tokens(impl: str, chunk_size: int) -> list[list[int]]:
  model = tiny_config.get_config().model
  model.attention_impl = impl
  scheduler_config = scheduler_lib.get_scheduler_config()
  scheduler_config.prefill_policy = "chunked" if chunk_size else "none"
  scheduler_config.chunk_size = chunk_size
  scheduler_config.max_num_batched_tokens = max(scheduler_config.max_num_batched_tokens,
                                                model.max_seq_len)
  engine = build.jax_engine(llama, model, llama.random_init(model, seed=0), scheduler_config,
                            num_pages=32, page_size=4)
  requests = engine.generate(PROMPTS, SamplingParams(max_tokens=NUM_NEW_TOKENS,
                                                     ignore_eos=True))
  return [request.output_ids for request in requests]


def test_pallas_and_reference_generate_the_same_greedy_tokens(monkeypatch):
  chunk_size = 8
  traces, errors = [], []
  kernel_entry = paged_attention.ragged_paged_attention

  def checked_entry(*args, interpret, decode_kernel, **kwargs):
    traces.append(interpret)
    assert decode_kernel == "triton"
    out = kernel_entry(*args, interpret=interpret, decode_kernel=decode_kernel, **kwargs)
    expected = reference.ragged_paged_attention(*args, **kwargs)
    error = jnp.max(jnp.abs(out - expected)) / jnp.maximum(jnp.max(jnp.abs(expected)), 1e-30)
    jax.debug.callback(lambda e: errors.append(float(e)), error)
    return out

  monkeypatch.setattr(paged_attention, "ragged_paged_attention", checked_entry)
  expected = greedy_tokens("reference", chunk_size)
  assert not traces, "the reference run must not touch the kernels"
  actual = greedy_tokens("pallas", chunk_size)
  assert traces and all(traces), "the pallas run must call the kernels (interpret on CPU)"
  num_layers = tiny_config.get_config().model.num_layers
  assert len(errors) >= num_layers * NUM_NEW_TOKENS  # every layer of every step
  assert np.max(errors) < 1e-5  # the tiny model is fp32
  assert [len(tokens) for tokens in expected] == [NUM_NEW_TOKENS] * len(PROMPTS)
  assert actual == expected


@pytest.mark.skipif(not hasattr(plgpu, "InterpretGPUParams"),
                    reason="Mosaic GPU's interpreter needs jax >= 0.11.2")
def test_the_mosaic_decode_kernel_generates_the_same_greedy_tokens(monkeypatch):
  """`attention_impl=mosaic`: decode-only steps on the Mosaic GPU kernel (mixed steps
  stay on the Triton ragged kernel), every call checked against the reference."""
  decode_calls, errors = [], []
  kernel = mosaic_decode.paged_decode_attention

  def checked(q, k_pages, v_pages, **kwargs):
    decode_calls.append(kwargs["interpret"])
    out = kernel(q, k_pages, v_pages, **kwargs)
    lens = kwargs["context_lens"]
    expected = reference.ragged_paged_attention(
        q, k_pages, v_pages, page_tables=kwargs["page_tables"], context_lens=lens,
        query_start_loc=jnp.arange(q.shape[0] + 1, dtype=jnp.int32))
    expected = jnp.where((lens > 0)[:, None, None], expected, 0)
    error = jnp.max(jnp.abs(out - expected)) / jnp.maximum(jnp.max(jnp.abs(expected)), 1e-30)
    jax.debug.callback(lambda e: errors.append(float(e)), error)
    return out

  monkeypatch.setattr(mosaic_decode, "paged_decode_attention", checked)
  expected = greedy_tokens("reference", chunk_size=8)
  actual = greedy_tokens("mosaic", chunk_size=8)
  assert decode_calls and all(decode_calls), "decode steps must run the Mosaic kernel"
  assert errors and np.max(errors) < 1e-5
  assert actual == expected
