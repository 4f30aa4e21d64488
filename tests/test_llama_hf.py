"""kvpage's Llama, loaded from Hugging Face checkpoints, matches transformers."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from hf_utils import hf_greedy, hf_logits, make_checkpoint

from configs import scheduler as scheduler_lib
from kvpage import batch as batch_lib
from kvpage import build
from kvpage.device import cache as paged_cache
from kvpage.host.scheduler import Scheduler
from kvpage.request import Request, SamplingParams
from models import hf, llama

SHAPES = {
    "gqa_untied": dict(num_heads=4, num_kv_heads=2),
    "mha_tied": dict(num_heads=4, num_kv_heads=4, tie=True),
    "odd_heads": dict(num_heads=3, num_kv_heads=3, head_dim=16),
    "gqa_8_to_1_scaled_rope": dict(num_heads=8, num_kv_heads=1, head_dim=8, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64)),
}
PROMPTS = [[5, 9, 13], list(range(1, 18)), [(7 * i) % 120 + 1 for i in range(33)],
           [3] * 40]

# One prompt step of 210 rows: more than the fp32 kernel's 128, so at
# `matmul_precision='high'` the products run on AMX where the CPU has it.
LONG_PROMPTS = [[(11 * i) % 127 + 1 for i in range(150)],
                [(5 * i + 3) % 127 + 1 for i in range(60)]]


def scheduler_config(chunk_size: int):
  config = scheduler_lib.get_scheduler_config()
  config.prefill_policy = "chunked" if chunk_size else "none"
  config.chunk_size = chunk_size
  return config


@pytest.fixture(scope="module", params=list(SHAPES))
def checkpoint(request, tmp_path_factory):
  directory = tmp_path_factory.mktemp(request.param)
  model = make_checkpoint(directory, **SHAPES[request.param])
  return directory, model


def prefill_logits(config, params, prompt: list[int], page_size: int = 16) -> np.ndarray:
  """Logits at every prompt position from one kvpage prefill step."""
  scheduler = Scheduler(scheduler_config(0), num_pages=32, page_size=page_size,
                        max_model_len=config.max_seq_len)
  scheduler.add_request(Request("r", prompt, SamplingParams(max_tokens=1)))
  step_batch, _ = batch_lib.build(scheduler.schedule().scheduled, page_size=page_size)
  step_batch = step_batch._replace(logits_indices=np.arange(len(prompt), dtype=np.int32))
  cache = paged_cache.init(config, num_pages=32, page_size=page_size)
  logits, _ = llama.forward(params, cache, step_batch, config=config)
  return np.asarray(logits)


def test_prefill_logits_match_transformers(checkpoint):
  directory, model = checkpoint
  config, params = hf.load(directory)
  for prompt in PROMPTS[1:3]:
    ours, theirs = prefill_logits(config, params, prompt), hf_logits(model, prompt)
    assert np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)) < 1e-4


# GPU configs' paths and CPU configs' kernels, each on all four shapes: the kernels over
# chunks (queries behind cached context), XLA over whole prompts. (Chunked and whole
# prefill are held equal to dense attention per implementation in test_attention and
# test_cpu_kernel.)
@pytest.mark.parametrize("impl, chunk_size", [("xla", 0), ("cpu", 8)])
def test_greedy_generation_matches_transformers(checkpoint, chunk_size, impl):
  directory, model = checkpoint
  config, params = hf.load(directory)
  config.attention_impl = config.linear_impl = impl
  engine = build.jax_engine(llama, config, params, scheduler_config(chunk_size), num_pages=64,
                            page_size=16)
  requests = engine.generate(PROMPTS, SamplingParams(max_tokens=32, ignore_eos=True))
  for prompt, request in zip(PROMPTS, requests):
    assert request.finish_reason == "length"
    assert request.output_ids == hf_greedy(model, prompt, 32), f"prompt of {len(prompt)}"


@pytest.mark.parametrize("shape", [dict(num_heads=4, num_kv_heads=2),  # head_dim 16
                                   dict(num_heads=4, num_kv_heads=2, head_dim=32)])
def test_long_prompts_at_high_precision_match_transformers(shape, tmp_path):
  # head_dim 32: attention's products on AMX too (head sizes that are multiples of 32).
  model = make_checkpoint(tmp_path, **shape)
  config, params = hf.load(tmp_path)
  config.attention_impl = config.linear_impl = "cpu"
  config.matmul_precision = "high"  # the CPU configs' choice
  engine = build.jax_engine(llama, config, params, scheduler_config(0), num_pages=64,
                            page_size=16)
  requests = engine.generate(LONG_PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))
  for prompt, request in zip(LONG_PROMPTS, requests):
    assert request.output_ids == hf_greedy(model, prompt, 16), f"prompt of {len(prompt)}"
  assert engine.scheduler.page_pool.num_free_pages == 63  # all pages back, null excluded


def test_sharded_checkpoint_and_dtype_conversion(tmp_path):
  model = make_checkpoint(tmp_path, max_shard_size="20KB")
  assert (tmp_path / "model.safetensors.index.json").exists()
  config, params = hf.load(tmp_path)
  assert np.max(np.abs(prefill_logits(config, params, PROMPTS[1]) - hf_logits(
      model, PROMPTS[1]))) < 1e-4 * np.max(np.abs(hf_logits(model, PROMPTS[1])))
  config16, params16 = hf.load(tmp_path, dtype="bf16")
  assert config16.dtype == "bf16"
  assert params16["layers_0"]["self_attn"]["q_proj"]["kernel"].dtype == jnp.bfloat16


def test_loader_errors_are_specific(tmp_path):
  with pytest.raises(hf.CheckpointError, match="does not exist"):
    hf.load(tmp_path / "nope")
  make_checkpoint(tmp_path)
  config_path = tmp_path / "config.json"
  original = json.loads(config_path.read_text())
  config_path.write_text(json.dumps({**original, "architectures": ["MistralForCausalLM"]}))
  with pytest.raises(hf.CheckpointError, match="unsupported architecture"):
    hf.load(tmp_path)
  config_path.write_text(json.dumps({**original, "intermediate_size": 100}))
  with pytest.raises(hf.CheckpointError, match=r"has shape \(96, 64\).*implies \(100, 64\)"):
    hf.load(tmp_path)
  config_path.write_text(json.dumps({**original, "tie_word_embeddings": False,
                                     "num_hidden_layers": 3}))
  with pytest.raises(hf.CheckpointError, match=r"model\.layers\.2\..* is missing"):
    hf.load(tmp_path)
  config_path.write_text(json.dumps([original]))
  with pytest.raises(hf.CheckpointError, match="JSON list, not an object"):
    hf.load(tmp_path)
  config_path.write_text(json.dumps({k: v for k, v in original.items() if k != "rms_norm_eps"}))
  with pytest.raises(hf.CheckpointError, match="missing or malformed field 'rms_norm_eps'"):
    hf.load(tmp_path)
  config_path.write_text(json.dumps(original))
  (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
  with pytest.raises(hf.CheckpointError, match="cannot read"):
    hf.load(tmp_path)
  (tmp_path / "model.safetensors").unlink()
  with pytest.raises(hf.CheckpointError, match=r"neither model\.safetensors"):
    hf.load(tmp_path)
