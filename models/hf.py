"""Load a Hugging Face Llama checkpoint directory into a kvpage model config and params.

A checkpoint directory holds `config.json` and either `model.safetensors` or shards
listed in `model.safetensors.index.json`. Tensors are read with safetensors (no torch)
and mapped by name onto `models.llama`'s parameter tree: HF stores linear weights as
`[out, in]`, Flax as `[in, out]`, so projections are transposed. Every tensor is
checked against the shape the config implies; problems raise `CheckpointError` (a
ValueError) that names the file, the tensor and the mismatch.
"""

import json
import pathlib
from typing import Any

import jax.numpy as jnp
import ml_collections
import safetensors

from configs import base
from kvpage import units
from kvpage.device import cache as paged_cache

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
# Checkpoint precisions loaded as they are; any other loads as fp32.
_CHECKPOINT_DTYPES = ("float32", "bfloat16", "float16")


_INT_FIELDS = ("num_attention_heads", "num_hidden_layers", "num_key_value_heads", "head_dim",
               "hidden_size", "intermediate_size", "vocab_size", "max_position_embeddings")


class CheckpointError(ValueError):
  """A checkpoint that cannot be loaded as it is; the message says why."""


def _read_json(path: pathlib.Path) -> dict:
  try:
    value = json.loads(path.read_text())
  except FileNotFoundError:
    raise CheckpointError(f"{path} is missing") from None
  except json.JSONDecodeError as error:
    raise CheckpointError(f"{path} is not valid JSON: {error}") from None
  if not isinstance(value, dict):
    raise CheckpointError(f"{path} holds a JSON {type(value).__name__}, not an object")
  return value


def _architectures(hf: dict) -> list:
  architectures = hf.get("architectures")
  if architectures is None:
    return [hf.get("model_type", "?")]
  if isinstance(architectures, str):
    raise CheckpointError(f'"architectures" must be a list of class names, got the string '
                          f"{architectures!r} (write [{architectures!r}])")
  if not isinstance(architectures, list):
    raise CheckpointError(f'"architectures" must be a list of class names, got '
                          f"{architectures!r}"[:200])
  return architectures


def _rope_scaling(hf: dict) -> dict:
  """`rope_parameters` (transformers >= 5, theta inside) or `rope_scaling` (older)."""
  keys = ("rope_parameters", "rope_scaling")
  for key in keys:
    value = hf.get(key)
    if value is not None and not isinstance(value, dict):
      raise CheckpointError(f'"{key}" must be an object such as {{"rope_type": "llama3", '
                            f"...}}, got {value!r}"[:200])
  return next((hf[key] for key in keys if hf.get(key)), {})


def model_config_from_hf(hf: dict, dtype: str | None = None) -> ml_collections.ConfigDict:
  """kvpage's `model` config section from a Hugging Face `config.json` dict."""
  architectures = _architectures(hf)
  if not {a for a in architectures if isinstance(a, str)} & set(SUPPORTED_ARCHITECTURES):
    raise CheckpointError(f"unsupported architecture {architectures}; kvpage loads "
                          f"{', '.join(SUPPORTED_ARCHITECTURES)}")
  for flag in ("attention_bias", "mlp_bias"):
    if hf.get(flag):
      raise CheckpointError(f"unsupported: {flag}=true (kvpage's Llama has no biases)")
  if hf.get("hidden_act", "silu") != "silu":
    raise CheckpointError(f"unsupported hidden_act {hf['hidden_act']!r}; only silu")
  stored = hf.get("torch_dtype") or hf.get("dtype")
  config = base.model_config("tiny", dtype or (
      units.canonical_dtype(stored) if stored in _CHECKPOINT_DTYPES else "fp32"))
  scaling = _rope_scaling(hf)
  for key in _INT_FIELDS:  # before the typed config sees them, to name the HF field
    value = hf.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
      raise CheckpointError(f'"{key}" must be an integer, got {value!r}'[:200])
  num_heads = hf["num_attention_heads"]
  config.update(dict(
      name=str(hf.get("_name_or_path") or "hf-llama"), num_layers=hf["num_hidden_layers"],
      num_heads=num_heads, num_kv_heads=hf.get("num_key_value_heads") or num_heads,
      head_dim=hf.get("head_dim") or _divide(hf["hidden_size"], num_heads),
      d_model=hf["hidden_size"], ffn_dim=hf["intermediate_size"], vocab_size=hf["vocab_size"],
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      rope_theta=float(hf.get("rope_theta") or scaling.get("rope_theta", 10000.0)),
      norm_eps=float(hf["rms_norm_eps"]),
      max_seq_len=hf.get("max_position_embeddings", 2048), source="Hugging Face config.json"))
  rope_type = scaling.get("rope_type", scaling.get("type"))
  if rope_type not in (None, "default", "llama3"):
    raise CheckpointError(f"unsupported rope_scaling type {rope_type!r}; kvpage supports "
                          "default and llama3")
  if rope_type == "llama3":
    config.rope_scaling.update(dict(
        enabled=True, factor=scaling["factor"], low_freq_factor=scaling["low_freq_factor"],
        high_freq_factor=scaling["high_freq_factor"],
        original_max_seq_len=scaling["original_max_position_embeddings"]))
  try:
    base.check_model(config, where="config.json")
  except ValueError as error:
    raise CheckpointError(str(error)) from None
  return config


def _divide(hidden_size: Any, num_heads: Any) -> Any:
  if isinstance(hidden_size, int) and isinstance(num_heads, int) and num_heads > 0:
    return hidden_size // num_heads
  return None  # check_model names the field


def _expected_tensors(c: ml_collections.ConfigDict) -> dict[str, tuple[tuple, tuple]]:
  """HF tensor name -> (HF shape, path in kvpage's param tree)."""
  d, hd = c.d_model, c.head_dim
  tensors = {"model.embed_tokens.weight": ((c.vocab_size, d), ("embed_tokens", "embedding")),
             "model.norm.weight": ((d,), ("norm", "weight"))}
  if not c.tie_embeddings:
    tensors["lm_head.weight"] = ((c.vocab_size, d), ("lm_head", "kernel"))
  per_layer = {
      "self_attn.q_proj": (c.num_heads * hd, d), "self_attn.k_proj": (c.num_kv_heads * hd, d),
      "self_attn.v_proj": (c.num_kv_heads * hd, d), "self_attn.o_proj": (d, c.num_heads * hd),
      "mlp.gate_proj": (c.ffn_dim, d), "mlp.up_proj": (c.ffn_dim, d),
      "mlp.down_proj": (d, c.ffn_dim)}
  for i in range(c.num_layers):
    for name, shape in per_layer.items():
      tensors[f"model.layers.{i}.{name}.weight"] = (shape, (f"layers_{i}", *name.split("."),
                                                            "kernel"))
    for norm in ("input_layernorm", "post_attention_layernorm"):
      tensors[f"model.layers.{i}.{norm}.weight"] = ((d,), (f"layers_{i}", norm, "weight"))
  return tensors


def _tensor_files(directory: pathlib.Path) -> dict[str, pathlib.Path]:
  """Tensor name -> safetensors file, for single-file and sharded checkpoints."""
  index = directory / "model.safetensors.index.json"
  if index.exists():
    weight_map = _read_json(index).get("weight_map", {})
    if not isinstance(weight_map, dict) or not all(
        isinstance(shard, str) for shard in weight_map.values()):
      raise CheckpointError(f'{index}: "weight_map" must map tensor names to shard file '
                            "names")
    return {name: directory / shard for name, shard in weight_map.items()}
  single = directory / "model.safetensors"
  if not single.exists():
    raise CheckpointError(f"{directory} has neither model.safetensors nor "
                          "model.safetensors.index.json")
  try:
    with safetensors.safe_open(single, framework="numpy") as f:
      return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
  except Exception as error:  # safetensors raises its own error types for bad files
    raise CheckpointError(f"cannot read {single}: {error}") from None


def load_config(checkpoint_dir: str | pathlib.Path,
                dtype: str | None = None) -> ml_collections.ConfigDict:
  """The model config of a Hugging Face Llama checkpoint directory, reading no weights."""
  directory = pathlib.Path(checkpoint_dir)
  if not directory.is_dir():
    raise CheckpointError(f"checkpoint directory {directory} does not exist")
  try:
    return model_config_from_hf(_read_json(directory / "config.json"), dtype)
  except (KeyError, TypeError, ValueError, OverflowError) as error:
    if isinstance(error, CheckpointError):
      raise CheckpointError(f"{directory / 'config.json'}: {error}") from None
    raise CheckpointError(f"{directory / 'config.json'}: missing or malformed field "
                          f"{error}") from None


def load(checkpoint_dir: str | pathlib.Path,
         dtype: str | None = None) -> tuple[ml_collections.ConfigDict, dict[str, Any]]:
  """`(model config, params)` from a Hugging Face Llama checkpoint directory.

  `dtype` (`fp32`, `bf16`, `fp16`) converts the weights; default: the checkpoint's.
  """
  directory = pathlib.Path(checkpoint_dir)
  config = load_config(directory, dtype)
  target = paged_cache.jnp_dtype(config.dtype)
  files = _tensor_files(directory)
  params: dict[str, Any] = {}
  for name, (shape, path) in _expected_tensors(config).items():
    if name not in files:
      raise CheckpointError(f"tensor {name} is missing from {directory}")
    if not files[name].exists():
      raise CheckpointError(f"shard {files[name]} (holding {name}) is missing")
    try:
      with safetensors.safe_open(files[name], framework="flax") as f:
        tensor = f.get_tensor(name)
    except Exception as error:  # safetensors raises its own error types for bad files
      raise CheckpointError(f"cannot read tensor {name} from {files[name]}: {error}") from None
    if tuple(tensor.shape) != shape:
      raise CheckpointError(f"tensor {name} has shape {tuple(tensor.shape)}, but config.json "
                            f"implies {shape}")
    value = jnp.asarray(tensor, target)
    node = params
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value.T if path[-1] == "kernel" else value
  return config, params



def load_tokenizer(checkpoint_dir: str | pathlib.Path) -> Any:
  """The checkpoint's Hugging Face tokenizer (text and chat templates for the gateway).

  transformers is needed for its tokenizer only (the `serve` extra); it loads no torch.
  """
  try:
    import transformers
  except ImportError:
    raise CheckpointError("reading text needs the Hugging Face tokenizer: "
                          "pip install -e '.[serve]'") from None
  try:
    return transformers.AutoTokenizer.from_pretrained(str(checkpoint_dir))
  except Exception as error:  # transformers raises OSError, ValueError, its own types
    raise CheckpointError(f"cannot load the tokenizer of {checkpoint_dir}: "
                          f"{str(error).splitlines()[0] if str(error) else error!r}") from None


def eos_token_ids(checkpoint_dir: str | pathlib.Path, tokenizer: Any = None) -> tuple[int, ...]:
  """The ids that end generation: `generation_config.json`'s `eos_token_id` (an id or a
  list, as Llama 3 lists several), else the tokenizer's end-of-sequence token."""
  path = pathlib.Path(checkpoint_dir) / "generation_config.json"
  value = _read_json(path).get("eos_token_id") if path.exists() else None
  if value is None and tokenizer is not None:
    value = tokenizer.eos_token_id
  ids = [value] if isinstance(value, int) else list(value or [])
  if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
    raise CheckpointError(f"{path}: eos_token_id must be a token id or a list of them, "
                          f"got {value!r}")
  return tuple(ids)
