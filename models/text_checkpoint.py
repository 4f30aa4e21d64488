"""A tiny Llama checkpoint that reads and writes text, made offline: no torch, no hub.

`make(directory)` writes what a Hugging Face Llama checkpoint holds, for kvpage's
`tiny` model (`configs/model_table.py`: 4 layers, d_model 256, GQA 4:2, vocabulary 512):

  * `tokenizer.json`: a byte-level BPE (the `tokenizers` library, in the `serve` extra)
    trained here on kvpage's own docstrings, read from its source files with `ast`
    (English prose that ships with the package); every byte is in its alphabet, so any
    text encodes, and three ChatML special tokens: `<|endoftext|>`, `<|im_start|>`,
    `<|im_end|>`;
  * `tokenizer_config.json` with a ChatML chat template, `special_tokens_map.json`;
  * `config.json` (`LlamaForCausalLM`), `generation_config.json` (ends at `<|im_end|>` or
    `<|endoftext|>`);
  * `model.safetensors`: random fp32 weights drawn with numpy from `seed`, but for the
    output head: the rows of tokens that are no text alone (a byte that is part of a
    multi-byte UTF-8 character, a control character, the special tokens) are zero and
    the others larger (`HEAD_STD`), so these tokens are seldom sampled (greedy: never)
    and what it writes prints.

The weights are random, so the text it writes is gibberish, but in real tokens through
a real tokenizer: every text path of the server (prompts, chat templates, stop strings,
incremental detokenizing) runs as it would on a trained model. `default_checkpoint()`
makes one once into a cache directory (`$KVPAGE_CACHE`, else `~/.cache/kvpage`) and
returns it: what `python -m experiments.serve` serves when given no model.
"""

import ast
import hashlib
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

MODEL = "tiny"  # the model_table entry whose shape the checkpoint has
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
VOCAB_SIZE = 512  # the tiny model's vocabulary: 256 bytes, 3 special tokens, 253 merges
WEIGHT_STD = 0.05  # normal(0, WEIGHT_STD) for every matrix; norms are ones
# The output head's text rows: logits of std HEAD_STD x sqrt(d_model) (~3) against the
# zero rows' 0, so at temperature 1 under 1% of samples are tokens that print badly.
HEAD_STD = 0.2
VERSION = 1  # bump when what `make` writes changes: the cache key carries it


def corpus() -> list[str]:
  """The tokenizer's training text: every docstring in kvpage's source, in path order."""
  import kvpage

  texts = []
  for path in sorted(pathlib.Path(kvpage.__file__).parent.rglob("*.py")):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        text = ast.get_docstring(node)
        if text:
          texts.append(text)
  return texts


def train_tokenizer(texts: list[str], vocab_size: int,
                    special_tokens: tuple[str, ...] = SPECIAL_TOKENS):
  """A byte-level BPE of at most `vocab_size` tokens (`special_tokens` first) over
  `texts`; every byte is in its alphabet, so any text encodes."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tokenizer.train_from_iterator(texts, trainer)
  return tokenizer


def llama_config(*, vocab_size: int, hidden_size: int, intermediate_size: int,
                 num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 max_len: int, special: dict[str, int | None]) -> dict:
  """A `config.json` of `LlamaForCausalLM` (fp32, untied head, rope 10,000); `special`
  maps `bos_token_id`, `eos_token_id` and `pad_token_id` to ids (or None)."""
  return dict(
      architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab_size,
      hidden_size=hidden_size, intermediate_size=intermediate_size,
      num_hidden_layers=num_layers, num_attention_heads=num_heads,
      num_key_value_heads=num_kv_heads, head_dim=head_dim, hidden_act="silu",
      max_position_embeddings=max_len, rms_norm_eps=1e-5, rope_theta=10000.0,
      tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
      torch_dtype="float32", **special)


def silent_tokens(tokenizer) -> list[int]:
  """Ids of the tokens that are no text alone: special, or decoding to a replacement or
  control character (a lone byte of a multi-byte character, a control byte)."""
  silent = []
  for i in range(tokenizer.get_vocab_size()):
    text = tokenizer.decode([i], skip_special_tokens=False)
    if tokenizer.id_to_token(i) in SPECIAL_TOKENS or any(
        char == "\ufffd" or (not char.isprintable() and char not in "\n\t") for char in text):
      silent.append(i)
  return silent


def random_weights(config: dict, seed: int, *, std: float = WEIGHT_STD,
                   head_std: float | None = None,
                   silent: Sequence[int] = ()) -> dict[str, np.ndarray]:
  """Hugging Face Llama tensors (`[out, in]` projections) for `config`, each matrix drawn
  from normal(0, `std`) in a fixed order from `seed`, norms ones; the output head from
  normal(0, `head_std`, default `std`) with the rows of the `silent` tokens zero."""
  rng = np.random.default_rng(seed)
  d, ffn, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
  q = config["num_attention_heads"] * config["head_dim"]
  kv = config["num_key_value_heads"] * config["head_dim"]

  def matrix(rows: int, columns: int, scale: float = std) -> np.ndarray:
    return rng.normal(0.0, scale, (rows, columns)).astype(np.float32)

  tensors = {"model.embed_tokens.weight": matrix(vocab, d)}
  for i in range(config["num_hidden_layers"]):
    layer = f"model.layers.{i}."
    tensors.update({
        layer + "input_layernorm.weight": np.ones(d, np.float32),
        layer + "self_attn.q_proj.weight": matrix(q, d),
        layer + "self_attn.k_proj.weight": matrix(kv, d),
        layer + "self_attn.v_proj.weight": matrix(kv, d),
        layer + "self_attn.o_proj.weight": matrix(d, q),
        layer + "post_attention_layernorm.weight": np.ones(d, np.float32),
        layer + "mlp.gate_proj.weight": matrix(ffn, d),
        layer + "mlp.up_proj.weight": matrix(ffn, d),
        layer + "mlp.down_proj.weight": matrix(d, ffn),
    })
  tensors["model.norm.weight"] = np.ones(d, np.float32)
  assert not config["tie_word_embeddings"], "the output head is drawn on its own"
  head = matrix(vocab, d, std if head_std is None else head_std)
  head[list(silent)] = 0.0
  tensors["lm_head.weight"] = head
  return tensors


def write(directory: str | pathlib.Path, *, config: dict, tokenizer: Any,
          tensors: dict[str, np.ndarray], tokenizer_config: dict,
          generation_config: dict, special_tokens_map: dict) -> pathlib.Path:
  """A Hugging Face checkpoint in `directory` (created; its files replaced), as
  `models.hf.load` and `transformers.AutoTokenizer.from_pretrained` read it."""
  from safetensors.numpy import save_file

  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  tokenizer.save(str(directory / "tokenizer.json"))
  files = {"config.json": config, "generation_config.json": generation_config,
           "tokenizer_config.json": tokenizer_config,
           "special_tokens_map.json": special_tokens_map}
  for name, value in files.items():
    (directory / name).write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
  save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
  return directory


def make(directory: str | pathlib.Path, *, seed: int = 0) -> pathlib.Path:
  """Writes the tiny text checkpoint into `directory` (created; its files replaced)."""
  from configs import model_table

  shape = model_table.MODEL_TABLE[MODEL]
  assert shape["vocab_size"] == VOCAB_SIZE, "the tiny model's vocabulary changed: retrain"
  tokenizer = train_tokenizer(corpus(), VOCAB_SIZE)
  special = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
  end, pad = special["<|im_end|>"], special["<|endoftext|>"]
  config = llama_config(
      vocab_size=VOCAB_SIZE, hidden_size=shape["d_model"], intermediate_size=shape["ffn_dim"],
      num_layers=shape["num_layers"], num_heads=shape["num_heads"],
      num_kv_heads=shape["num_kv_heads"], head_dim=shape["head_dim"],
      max_len=shape["max_seq_len"],
      special=dict(bos_token_id=None, eos_token_id=end, pad_token_id=pad))
  added = {str(i): dict(content=token, lstrip=False, normalized=False, rstrip=False,
                        single_word=False, special=True) for token, i in special.items()}
  return write(
      directory, config=config, tokenizer=tokenizer,
      tensors=random_weights(config, seed, head_std=HEAD_STD,
                             silent=silent_tokens(tokenizer)),
      tokenizer_config=dict(
          tokenizer_class="PreTrainedTokenizerFast", model_max_length=shape["max_seq_len"],
          eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None, unk_token=None,
          add_bos_token=False, add_eos_token=False, clean_up_tokenization_spaces=False,
          added_tokens_decoder=added, chat_template=CHAT_TEMPLATE),
      generation_config=dict(eos_token_id=[end, pad], pad_token_id=pad),
      special_tokens_map=dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"))


def cache_root() -> pathlib.Path:
  """Where made checkpoints are kept: `$KVPAGE_CACHE`, else `~/.cache/kvpage`."""
  return pathlib.Path(os.environ.get("KVPAGE_CACHE") or pathlib.Path.home() / ".cache" / "kvpage")


def default_checkpoint(seed: int = 0) -> pathlib.Path:
  """The checkpoint `make` writes, made once per corpus, version and seed into
  `cache_root()` (in a temporary folder first, then renamed: two processes starting at
  once both end with a whole checkpoint) and returned."""
  key = hashlib.sha256(json.dumps([VERSION, seed, corpus()]).encode()).hexdigest()[:12]
  target = cache_root() / f"tiny-text-{key}"
  if (target / "model.safetensors").exists():
    return target
  target.parent.mkdir(parents=True, exist_ok=True)
  staging = pathlib.Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
  staging.chmod(0o755)
  try:
    make(staging, seed=seed)
    try:
      staging.rename(target)
    except OSError:  # another process renamed its copy first: use that one
      if not (target / "model.safetensors").exists():
        raise
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  return target
