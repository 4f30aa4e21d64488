"""Log-probabilities from the step that samples: each sampled token's and the likeliest
ones, in float32, equal transformers' `log_softmax` within 1e-4 on two checkpoints;
greedy and sampled, chunked or not; and a request that asks none pays for none."""

import numpy as np
import pytest
from hf_utils import hf_logits, make_checkpoint

from configs import scheduler as scheduler_lib
from kvpage import build
from kvpage.request import SamplingParams
from models import hf, llama

torch = pytest.importorskip("torch", reason="the parity reference is transformers on torch")

CHECKPOINTS = {"gqa_untied": dict(num_heads=4, num_kv_heads=2),
               "mha_tied": dict(num_heads=4, num_kv_heads=4, tie=True, seed=3)}
PROMPTS = [[5, 9, 13], list(range(1, 18)), [(7 * i) % 120 + 1 for i in range(33)]]
TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
  directory = tmp_path_factory.mktemp(request.param)
  return directory, make_checkpoint(directory, **CHECKPOINTS[request.param])


def _engine(directory, chunk_size: int, prefix_caching: bool = False, **knobs):
  config, params = hf.load(directory)
  scheduler = scheduler_lib.get_scheduler_config()
  scheduler.prefill_policy = "chunked" if chunk_size else "none"
  scheduler.chunk_size = chunk_size
  scheduler.update(knobs)
  return build.jax_engine(llama, config, params, scheduler, num_pages=64, page_size=16,
                          prefix_caching=prefix_caching)


def _reference(model, prompt: list[int], output: list[int]) -> np.ndarray:
  """transformers' log-softmax at each output position (teacher-forced), float64."""
  logits = hf_logits(model, prompt + output[:-1]).astype(np.float64)
  scores = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(
      -1, keepdims=True)) - logits.max(-1, keepdims=True)
  return scores[len(prompt) - 1:]


# Chunking and temperature act on different ends of the step (the prompt's pages, the
# sampler): each pair covers one of each, on both checkpoints.
@pytest.mark.parametrize("chunk_size, temperature", [(0, 0.8), (8, 0.0)])
def test_sampled_and_top_logprobs_match_transformers(checkpoint, chunk_size, temperature):
  directory, model = checkpoint
  engine = _engine(directory, chunk_size)
  sampling = SamplingParams(max_tokens=12, ignore_eos=True, temperature=temperature, seed=7,
                            logprobs=5)
  for prompt, request in zip(PROMPTS, engine.generate(PROMPTS, sampling), strict=True):
    assert len(request.output_logprobs) == len(request.output_ids) == 12
    reference = _reference(model, prompt, request.output_ids)
    for position, (token, entry) in enumerate(zip(request.output_ids, request.output_logprobs,
                                                  strict=True)):
      expected = reference[position]
      assert entry.token_id == token
      assert abs(entry.logprob - expected[token]) < TOLERANCE
      assert len(entry.top) == 5
      ids, values = zip(*entry.top, strict=True)
      np.testing.assert_allclose(values, np.sort(expected)[::-1][:5], atol=TOLERANCE)
      assert list(values) == sorted(values, reverse=True)
      assert all(abs(expected[i] - v) < TOLERANCE for i, v in zip(ids, values, strict=True))
      if temperature == 0:  # greedy: the sampled token is the likeliest
        assert ids[0] == token


def test_a_request_without_logprobs_gets_none_beside_one_with(checkpoint):
  directory, _ = checkpoint
  engine = _engine(directory, 0)
  plain, scored = engine.generate(
      PROMPTS[:2], [SamplingParams(max_tokens=4, ignore_eos=True),
                    SamplingParams(max_tokens=4, ignore_eos=True, logprobs=0)])
  assert plain.output_logprobs == []
  assert len(scored.output_logprobs) == 4 and all(e.top == () for e in scored.output_logprobs)
  alone = _engine(directory, 0).generate(PROMPTS[:1], SamplingParams(max_tokens=4,
                                                                     ignore_eos=True))
  assert alone[0].output_ids == plain.output_ids  # scoring a neighbour changes nothing


def test_logprobs_are_bounded():
  with pytest.raises(ValueError, match="logprobs must be in"):
    SamplingParams(max_tokens=1, logprobs=21)


@pytest.mark.parametrize("chunk_size", [0, 8])
def test_prompt_logprobs_match_transformers_and_skip_the_prefix_cache(checkpoint, chunk_size):
  directory, model = checkpoint
  engine = _engine(directory, chunk_size, prefix_caching=True)
  prompt = PROMPTS[2]  # 33 tokens: two full pages, a cache hit for a second request
  logits = hf_logits(model, prompt).astype(np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  expected = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))  # row p scores p + 1
  sampling = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=3)
  for _ in range(2):  # the second run would find the prompt's pages cached
    (request,) = engine.generate([prompt], sampling)
    scored = request.prompt_logprobs
    assert len(scored) == len(prompt) and scored[0] is None
    for position in range(1, len(prompt)):
      entry, row = scored[position], expected[position - 1]
      assert entry.token_id == prompt[position]
      assert abs(entry.logprob - row[prompt[position]]) < TOLERANCE
      ids, values = zip(*entry.top, strict=True)
      np.testing.assert_allclose(values, np.sort(row)[::-1][:3], atol=TOLERANCE)
      assert all(abs(row[i] - v) < TOLERANCE for i, v in zip(ids, values, strict=True))
    assert request.output_logprobs == []  # (none asked for the samples)
  assert engine.scheduler.page_pool.prefix.stats.hit_tokens == 0  # computed, not looked up
  # A request that does not ask reuses the pages the scored ones left.
  engine.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))
  assert engine.scheduler.page_pool.prefix.stats.hit_tokens == 32


@pytest.fixture(scope="module")
def gqa_checkpoint(tmp_path_factory):
  directory = tmp_path_factory.mktemp("warm_up_gqa_untied")
  make_checkpoint(directory, **CHECKPOINTS["gqa_untied"])
  return directory


# The warmed shapes are the batch's, not the model's: one checkpoint shows it (half a
# minute each on a CPU).
def test_a_logprobs_warm_up_leaves_nothing_to_compile_when_requests_ask(gqa_checkpoint):
  directory = gqa_checkpoint
  # A small batch (2 sequences, 16 tokens): the warm-up compiles every shape it allows,
  # three programs each, and the default's 256 x 2,048 would take minutes on a CPU.
  engine = _engine(directory, 8, max_num_seqs=2, max_num_batched_tokens=16)
  config = engine.scheduler.config
  said = []
  count = engine.executor.warmup(config.max_num_seqs, config.max_num_batched_tokens,
                                 logprobs=True, progress=lambda done, total: said.append(
                                     (done, total)))
  assert said[-1] == (count, count)
  compiled = engine.executor.num_compiles
  engine.generate(PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2,
                                          prompt_logprobs=2))
  assert engine.executor.num_compiles == compiled  # every scored step was warmed up
