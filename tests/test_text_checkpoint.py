"""The tiny text checkpoint: made offline, loaded by kvpage and by transformers, the
same bytes from the same seed, any text through its tokenizer, an output head that
keeps the tokens that print badly out of greedy text; and its CLI's refusals."""

import json

import numpy as np
import pytest
import safetensors.numpy
from cli_harness import Worker

from models import hf, text_checkpoint


@pytest.fixture(scope="module")
def made(tmp_path_factory):
  return text_checkpoint.make(tmp_path_factory.mktemp("tiny_text"))


def test_kvpage_and_transformers_load_it(made):
  config, _ = hf.load(str(made))
  assert (config.vocab_size, config.d_model, config.num_layers) == (512, 256, 4)
  tokenizer = hf.load_tokenizer(made)
  assert len(tokenizer) == text_checkpoint.VOCAB_SIZE
  assert hf.eos_token_ids(made, tokenizer) == (tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                               tokenizer.convert_tokens_to_ids("<|endoftext|>"))
  text = "The cache: naïve 日本語 🙂 \t\n x = [1, 2]"
  assert tokenizer.decode(tokenizer.encode(text)) == text  # every byte encodes
  chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}],
                                       add_generation_prompt=True, tokenize=False)
  assert chat == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"


def test_the_same_seed_writes_the_same_bytes(made, tmp_path):
  again = text_checkpoint.make(tmp_path / "again")
  for name in ("model.safetensors", "tokenizer.json", "config.json"):
    assert (again / name).read_bytes() == (made / name).read_bytes(), name
  other = text_checkpoint.make(tmp_path / "other", seed=1)
  assert (other / "model.safetensors").read_bytes() != (made / "model.safetensors").read_bytes()


def test_the_output_head_silences_tokens_that_print_badly(made):
  from tokenizers import Tokenizer

  tokenizer = Tokenizer.from_file(str(made / "tokenizer.json"))
  silent = text_checkpoint.silent_tokens(tokenizer)
  head = safetensors.numpy.load_file(made / "model.safetensors")["lm_head.weight"]
  assert not head[silent].any()
  assert np.count_nonzero(np.abs(head).sum(axis=1)) == len(head) - len(silent)
  # A lone byte of a multi-byte character, a control byte and the specials are silent;
  # words and ASCII are not.
  ids = {tokenizer.token_to_id(token) for token in text_checkpoint.SPECIAL_TOKENS}
  assert ids <= set(silent)
  lone = tokenizer.encode("é").ids  # two byte tokens, or one merged token
  assert all(i in silent for i in lone) or len(lone) == 1
  assert tokenizer.token_to_id("a") not in silent


def test_the_default_checkpoint_is_made_once_into_the_cache(monkeypatch, tmp_path):
  monkeypatch.setenv("KVPAGE_CACHE", str(tmp_path))
  first = text_checkpoint.default_checkpoint()
  stamp = (first / "model.safetensors").stat().st_mtime_ns
  assert text_checkpoint.default_checkpoint() == first
  assert (first / "model.safetensors").stat().st_mtime_ns == stamp
  assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no staging folder left
  assert json.loads((first / "config.json").read_text())["vocab_size"] == 512


@pytest.fixture(scope="module")
def make_checkpoint_worker():
  worker = Worker("make_checkpoint")
  yield worker
  worker.close()


def test_the_cli_writes_a_checkpoint_and_refuses_a_used_directory(make_checkpoint_worker,
                                                                  tmp_path):
  out = tmp_path / "ck"
  rc, stderr = make_checkpoint_worker.run([f"--out={out}"])
  assert rc == 0, stderr
  assert (out / "model.safetensors").exists() and (out / "tokenizer_config.json").exists()
  rc, stderr = make_checkpoint_worker.run([f"--out={out}"])
  assert rc == 2 and stderr.strip() == (f"error: --out={out} exists and is not an empty "
                                        "directory")
  rc, stderr = make_checkpoint_worker.run(["--out="])
  assert rc == 2 and stderr.strip() == "error: --out must name a directory"
