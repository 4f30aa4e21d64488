"""The served test checkpoint loads in kvpage and in transformers, and they agree."""

import json

import pytest
import transformers
from serve_utils import make_served_checkpoint

from models import hf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  return make_served_checkpoint(tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
  return transformers.AutoTokenizer.from_pretrained(checkpoint)


def test_model_and_tokenizer_share_the_vocabulary(checkpoint, tokenizer):
  config, params = hf.load(checkpoint)
  assert config.vocab_size == len(tokenizer) == 384
  assert params["embed_tokens"]["embedding"].shape == (384, 64)
  assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
  assert all(i < config.vocab_size for i in (tokenizer.bos_token_id, tokenizer.eos_token_id,
                                             tokenizer.pad_token_id))


def test_multi_byte_text_round_trips(tokenizer):
  text = "naïve café 日本語 🙂"
  ids = tokenizer.encode(text, add_special_tokens=False)
  assert tokenizer.decode(ids) == text
  # Token strings joined back give the text too, though a character may span tokens.
  pieces = tokenizer.convert_ids_to_tokens(ids)
  assert tokenizer.convert_tokens_to_string(pieces) == text


def test_chat_template(tokenizer):
  prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                         add_generation_prompt=True, tokenize=False)
  assert prompt == "<s><|user|>\nhi</s>\n<|assistant|>\n"
  ids = tokenizer.encode(prompt, add_special_tokens=False)
  assert ids[0] == tokenizer.bos_token_id and tokenizer.eos_token_id in ids


def test_eos_matches_generation_config(checkpoint, tokenizer):
  generation = json.loads((checkpoint / "generation_config.json").read_text())
  assert generation["eos_token_id"] == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids(
      "</s>")


def test_deterministic_per_seed(tmp_path, checkpoint):
  again = make_served_checkpoint(tmp_path / "again")
  other = make_served_checkpoint(tmp_path / "other", seed=1)
  for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors"):
    assert (again / name).read_bytes() == (checkpoint / name).read_bytes(), name
  assert (other / "tokenizer.json").read_bytes() == (checkpoint / "tokenizer.json").read_bytes()
  assert (other / "model.safetensors").read_bytes() != (
      checkpoint / "model.safetensors").read_bytes()
