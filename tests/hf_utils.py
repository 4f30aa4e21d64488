"""Tiny random Hugging Face Llama checkpoints for parity tests (torch is test-only).

torch is imported when a checkpoint is made, not with this module: where no torch
wheel exists (Python 3.12 on these machines) a test that needs one skips, and the
other tests of its module still run.
"""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
  import transformers


def _torch_and_transformers():
  torch = pytest.importorskip("torch", reason="torch parity checks need a torch wheel")
  import transformers  # after torch: its Llama classes need it

  return torch, transformers


def make_checkpoint(directory: pathlib.Path, *, num_heads: int = 4, num_kv_heads: int = 2,
                    head_dim: int = 16, num_layers: int = 2, vocab_size: int = 128,
                    ffn_dim: int = 96, tie: bool = False, seed: int = 0,
                    max_shard_size: str | None = None,
                    rope_scaling: dict | None = None) -> transformers.LlamaForCausalLM:
  """Saves a random `LlamaForCausalLM` to `directory` and returns it (fp32, eval mode)."""
  torch, transformers = _torch_and_transformers()
  kwargs = dict(vocab_size=vocab_size, hidden_size=num_heads * head_dim,
                intermediate_size=ffn_dim, num_hidden_layers=num_layers,
                num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                head_dim=head_dim, max_position_embeddings=512, tie_word_embeddings=tie,
                rms_norm_eps=1e-5, rope_theta=10000.0)
  if rope_scaling:
    kwargs["rope_scaling"] = rope_scaling
  config = transformers.LlamaConfig(**kwargs)
  torch.manual_seed(seed)
  model = transformers.LlamaForCausalLM(config).eval()
  with torch.no_grad():  # Bigger weights than the default init make greedy choices decisive.
    for param in model.parameters():
      if param.dim() == 2:
        param.normal_(0.0, 0.08)
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = 0
  save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
  model.save_pretrained(directory, **save_kwargs)
  return model


def hf_greedy(model: transformers.LlamaForCausalLM, prompt: list[int],
              max_new_tokens: int) -> list[int]:
  torch, _ = _torch_and_transformers()
  with torch.no_grad():
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False)
  return out[0, len(prompt):].tolist()


def hf_logits(model: transformers.LlamaForCausalLM, prompt: list[int]):
  torch, _ = _torch_and_transformers()
  with torch.no_grad():
    return model(torch.tensor([prompt])).logits[0].numpy()
