r"""Generate tokens for a few prompts, together, through the paged cache.

  python -m experiments.generate --config=configs/tiny.py --prompt_ids="1,2,3;4,5" \
      --max_new_tokens=16
  python -m experiments.generate --checkpoint=/path/to/hf_llama --prompt_ids="1,15043" \
      --chunk_size=8 --temperature=0.8 --seed=1
  XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m experiments.generate \
      --config=configs/tiny.py --tensor_parallel=4   # one step over 4 (CPU) devices

Multi-process (one process per host; docs/multi_device.md): the same command on every
process, plus `--coordinator_address=HOST:PORT --num_processes=N --process_id=I`;
process 0 prints the outputs.

All prompts are submitted at once and decoded as one continuously batched run (the
same scheduler, batch builder and jitted step as the server). Prints one JSON line
per prompt: `{"prompt_ids": [...], "output_ids": [...]}`.
"""

import json
import math

from absl import flags

from configs import base as configs_check
from experiments import cli
from kvpage import build, sizing, units
from kvpage.host.engine import Engine
from kvpage.request import Request, SamplingParams
from models import llama

_CONFIG = cli.define_config("configs/tiny.py",
                            "Config for random weights (ignored with --checkpoint).")
_TENSOR_PARALLEL = cli.define_tensor_parallel()
_PROCESSES = cli.define_processes()
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Hugging Face Llama checkpoint dir.")
_PROMPT_IDS = flags.DEFINE_string("prompt_ids", "1,2,3;4,5", "Prompts: ids `,`, prompts `;`.")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 16, "Tokens to generate per prompt.")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per KV page.")
_CHUNK_SIZE = flags.DEFINE_integer("chunk_size", 0, "Prefill chunk; 0 = whole prompt.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "0 = off.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "1 = off.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed (prompt i uses seed + i).")
_ATTENTION = flags.DEFINE_string("attention_impl", None,
                                 "xla | reference | pallas (default: config).")


def parse_prompts(text: str, vocab_size: int) -> list[list[int]]:
  """`"1,2,3;4,5"` -> `[[1, 2, 3], [4, 5]]`, checking every id against the vocabulary."""
  prompts = []
  for number, part in enumerate(text.split(";")):
    try:
      ids = [int(token) for token in part.split(",") if token.strip()]
    except ValueError:
      raise ValueError(f"--prompt_ids: prompt {number} ({part!r}) is not a list of "
                       "comma-separated integers") from None
    if not ids:
      raise ValueError(f"--prompt_ids: prompt {number} is empty")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
      raise ValueError(f"--prompt_ids: prompt {number} has ids {bad} outside the "
                       f"vocabulary [0, {vocab_size})")
    prompts.append(ids)
  return prompts


def check_flags() -> None:
  """Rejects flag values that would run but mean nothing (a NaN temperature) or
  could never run (a negative page size), before anything is built."""
  if _MAX_NEW_TOKENS.value <= 0 or _PAGE_SIZE.value <= 0 or _CHUNK_SIZE.value < 0:
    raise ValueError("--max_new_tokens and --page_size must be > 0, --chunk_size >= 0")
  if not 0 <= _TEMPERATURE.value < math.inf:  # NaN fails every comparison
    raise ValueError(f"--temperature must be a finite number >= 0, got {_TEMPERATURE.value}")
  if not 0 < _TOP_P.value <= 1:
    raise ValueError(f"--top_p must be in (0, 1], got {_TOP_P.value}")
  if not 0 <= _TOP_K.value < 2**31:  # sampled on the device as an int32
    raise ValueError(f"--top_k must be in [0, 2**31), got {_TOP_K.value}")
  if not 0 <= _SEED.value < 2**32 - 2**16:  # room for seed + i over the prompts
    raise ValueError(f"--seed must be in [0, 2**32 - 2**16), got {_SEED.value}")


def main(argv: list[str]) -> None:
  del argv  # Unused.
  check_flags()
  cli.initialize_processes(_PROCESSES)
  config = cli.load_config_with_mesh(_CONFIG, _TENSOR_PARALLEL)
  if _ATTENTION.value:  # a shortcut for --config.model.attention_impl
    config.model.attention_impl = _ATTENTION.value
  configs_check.check(config)
  params = cli.load_checkpoint(config, _CHECKPOINT.value) if _CHECKPOINT.value else None
  model_config = config.model
  sizing.check_runnable(config)
  prompts = parse_prompts(_PROMPT_IDS.value, model_config.vocab_size)
  page_size = _PAGE_SIZE.value
  # Pages for each prompt's whole run; one longer than the context would be rejected
  # at admission anyway, so it needs no more than the context's worth.
  num_pages = 1 + sum(units.cdiv(min(len(p) + _MAX_NEW_TOKENS.value, model_config.max_seq_len),
                                 page_size) for p in prompts)
  hint = "fewer or shorter prompts, or a smaller --page_size"
  if not _CHECKPOINT.value:
    sizing.check_memory(model_config, num_pages=num_pages, page_size=page_size, hint=hint,
                       tensor_parallel=config.mesh.tensor_parallel)
    params = llama.random_init(model_config, config.seed)
  scheduler_config = config.scheduler
  scheduler_config.prefill_policy = "chunked" if _CHUNK_SIZE.value else "none"
  scheduler_config.chunk_size = _CHUNK_SIZE.value
  scheduler_config.max_num_batched_tokens = max(
      scheduler_config.max_num_batched_tokens,
      sizing.max_model_len(model_config, num_pages=num_pages, page_size=page_size))
  scheduler_config.watermark = 0.0  # an offline batch: every prompt is meant to run
  engine = build.jax_engine(llama, model_config, params, scheduler_config, num_pages=num_pages,
                            page_size=page_size, memory_hint=hint,
                            tensor_parallel=config.mesh.tensor_parallel,
                            prefix_caching=config.cache.prefix_caching)
  if build.follow(engine):  # a process other than 0 of a multi-process run
    return
  try:
    requests = _run(engine, prompts)
  finally:
    build.stop_followers(engine)
  for request in requests:
    print(json.dumps({"prompt_ids": request.prompt_ids, "output_ids": request.output_ids}))


def _run(engine: Engine, prompts: list[list[int]]) -> list[Request]:
  """Submits every prompt, then runs the engine until all are done."""
  requests = []
  for i, prompt in enumerate(prompts):
    sampling = SamplingParams(max_tokens=_MAX_NEW_TOKENS.value, temperature=_TEMPERATURE.value,
                              top_k=_TOP_K.value, top_p=_TOP_P.value, seed=_SEED.value + i,
                              ignore_eos=True)
    request, answer = engine.add_request(prompt, sampling)
    if not answer.admitted:
      raise ValueError(f"prompt {i} rejected ({answer.status}): {answer.reason}")
    requests.append(request)
  engine.run_until_done()
  return requests


if __name__ == "__main__":
  cli.run(main)
