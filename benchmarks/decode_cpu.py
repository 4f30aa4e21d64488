r"""Decode throughput of kvpage's jitted step vs Hugging Face `generate`, same weights.

  python -m benchmarks.decode_cpu --out=decode_cpu.json

Builds a random `LlamaForCausalLM` with the tiny config's dimensions, saves it, loads
the same weights into kvpage, and for batch 1/8/32 generates `--new_tokens` tokens
from `--prompt_len`-token prompts with greedy decoding, all sequences together:
  * kvpage: `Engine.generate` (scheduler + batch builder + jitted paged step), after a
    warm-up run that compiles every bucket used;
  * transformers: batched greedy `generate` with its default dynamic cache and with
    `cache_implementation="static"`; the faster is reported as HF's best.
Generated tokens/s = batch x new tokens / wall time (prefill included for both).
kvpage runs with async scheduling (the default: step N+1 is scheduled and launched
while step N runs) and, for comparison, synchronously. For each, the batches the
engine launched are replayed through the jitted step alone, back to back: `step ms`
is that executor time per step, `host +%` what the engine's host work (scheduling,
batch building, bookkeeping) adds to it (engine wall / replay - 1). Compilations
during the timed runs are counted (expected: 0).
Requires the `test` extra (torch, transformers).
"""

import json
import pathlib
import tempfile
import time

import jax
import numpy as np
import torch
import transformers
from absl import flags
from ml_collections import config_flags

from experiments import build, cli
from kvpage import premises
from kvpage.request import SamplingParams
from models import hf

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "Model dimensions.")
_BATCHES = flags.DEFINE_list("batches", ["1", "8", "32"], "Batch sizes.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 32, "Prompt tokens per sequence.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 64, "Generated tokens per sequence.")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per KV page.")
_REPEATS = flags.DEFINE_integer("repeats", 7, "Timed rounds; each contender runs once a "
                                "round, best is kept.")
_OUT = flags.DEFINE_string("out", "decode_cpu.json", "Where to write the JSON record.")


def save_random_checkpoint(model_config, directory: pathlib.Path):
  hf_config = transformers.LlamaConfig(
      vocab_size=model_config.vocab_size, hidden_size=model_config.d_model,
      intermediate_size=model_config.ffn_dim, num_hidden_layers=model_config.num_layers,
      num_attention_heads=model_config.num_heads, num_key_value_heads=model_config.num_kv_heads,
      head_dim=model_config.head_dim, max_position_embeddings=model_config.max_seq_len,
      rms_norm_eps=model_config.norm_eps, rope_theta=model_config.rope_theta,
      tie_word_embeddings=model_config.tie_embeddings)
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(hf_config).eval()
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = 0
  model.save_pretrained(directory)
  return model


_BACKEND_COMPILES = []  # every XLA compilation in this process (jax.monitoring)


def _count_compiles(event: str, seconds: float, **kwargs) -> None:
  del seconds, kwargs  # Unused.
  if event == "/jax/core/compile/backend_compile_duration":
    _BACKEND_COMPILES.append(event)


class RecordingStep:
  """Wraps the executor's jitted step to keep every batch it launches, for `replay_steps`."""

  def __init__(self, step):
    self.step, self.records = step, []

  def __getattr__(self, name):
    return getattr(self.step, name)

  def dispatch(self, params, cache, batch, all_greedy, feed=None):
    self.records.append((batch, all_greedy))
    return self.step.dispatch(params, cache, batch, all_greedy, feed)


def replay_steps(executor, records) -> float:
  """Seconds the executor's step alone takes for `records`, back to back.

  Each step is launched and waited for (sampled ids to numpy), feeding the next from
  its output as the engine does: the engine's wall time minus this is what its host
  work (scheduling, batch building, bookkeeping) adds.
  """
  step = executor.step.step
  feed = None
  start = time.perf_counter()
  for batch, all_greedy in records:
    feed, executor.cache = step.dispatch(executor.params, executor.cache, batch, all_greedy,
                                         feed)
    np.asarray(feed)
  return time.perf_counter() - start


class KvpageContender:
  """One engine: each `run()` times `generate`, then replays its batches (`replay_steps`)."""

  def __init__(self, engine, prompts, new_tokens):
    self.engine, self.prompts = engine, prompts
    self.sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    self.recording = engine.executor.step = RecordingStep(engine.executor.step)
    self.walls, self.steps, self.num_steps = [], [], 0
    self.run()  # warm-up: compiles every bucket this run uses
    self.walls, self.steps = [], []

  def run(self) -> None:
    self.recording.records = []
    start = time.perf_counter()
    requests = self.engine.generate(self.prompts, self.sampling)
    self.walls.append(time.perf_counter() - start)
    if any(len(r.output_ids) != self.sampling.max_tokens for r in requests):
      raise RuntimeError("kvpage generated the wrong number of tokens")
    self.num_steps = len(self.recording.records)
    self.steps.append(replay_steps(self.engine.executor, self.recording.records))

  def result(self) -> dict:
    wall, step = min(self.walls), min(self.steps)
    return dict(wall_s=wall, step_s=step, host_added=wall / step - 1, num_steps=self.num_steps,
                walls_s=self.walls, replays_s=self.steps)


class HfContender:
  """Batched greedy `generate` with one cache implementation; `None` if it cannot run."""

  def __init__(self, model, prompts, new_tokens, cache):
    self.model, self.inputs, self.walls = model, torch.tensor(prompts), []
    self.kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if cache == "static":
      self.kwargs["cache_implementation"] = "static"
    self.error = None
    try:
      self.run()  # warm-up
    except Exception as error:  # an unsupported cache in this transformers version
      self.error = f"n/a: {type(error).__name__}: {error}"
    self.walls = []

  def run(self) -> None:
    if self.error:
      return
    with torch.inference_mode():
      start = time.perf_counter()
      self.model.generate(self.inputs, **self.kwargs)
      self.walls.append(time.perf_counter() - start)

  def result(self) -> float | str:
    return self.error or min(self.walls)


def main(argv: list[str]) -> None:
  del argv  # Unused.
  jax.monitoring.register_event_duration_secs_listener(_count_compiles)
  config = cli.load_config(_CONFIG)
  model_config = config.model
  rng = np.random.default_rng(0)
  rows = []
  with tempfile.TemporaryDirectory() as directory:
    hf_model = save_random_checkpoint(model_config, pathlib.Path(directory))
    loaded_config, params = hf.load(directory)
  print(f"decode throughput: {model_config.name} ({model_config.num_layers} layers, d_model "
        f"{model_config.d_model}, {model_config.num_heads}/{model_config.num_kv_heads} heads, "
        f"vocab {model_config.vocab_size}), fp32, greedy, prompt {_PROMPT_LEN.value} + "
        f"{_NEW_TOKENS.value} new tokens, page size {_PAGE_SIZE.value}, CPU, torch threads "
        f"{torch.get_num_threads()}")
  print(f"{'batch':>5} {'kvpage tok/s':>13} {'HF tok/s':>10} {'HF cache':>9} {'ratio':>6} "
        f"{'step ms':>8} {'engine ms':>9} {'host +%':>8} {'sync tok/s':>10} {'sync +%':>8} "
        f"{'recompiles':>10}")
  for batch in map(int, _BATCHES.value):
    prompts = rng.integers(1, model_config.vocab_size, (batch, _PROMPT_LEN.value)).tolist()
    num_pages = 1 + batch * -(-(_PROMPT_LEN.value + _NEW_TOKENS.value) // _PAGE_SIZE.value)
    config.scheduler.watermark = 0.0  # an offline batch sized to fit: admit everything
    contenders = {}
    for mode in (True, False):  # async scheduling (the default), then synchronous
      config.scheduler.async_scheduling = mode
      engine = build.llama_engine(loaded_config, params, config.scheduler, num_pages=num_pages,
                                  page_size=_PAGE_SIZE.value)
      contenders["async" if mode else "sync"] = KvpageContender(engine, prompts,
                                                                _NEW_TOKENS.value)
    for cache in ("dynamic", "static"):
      contenders[cache] = HfContender(hf_model, prompts, _NEW_TOKENS.value, cache)
    # Round-robin, best of `repeats` each: this VM's speed drifts, so timing the
    # contenders in separate phases would compare different machines.
    compiles_before = len(_BACKEND_COMPILES)
    for _ in range(_REPEATS.value):
      for contender in contenders.values():
        contender.run()
    recompiles = len(_BACKEND_COMPILES) - compiles_before
    ours, sync = contenders["async"].result(), contenders["sync"].result()
    theirs = {cache: contenders[cache].result() for cache in ("dynamic", "static")}
    numeric = {k: v for k, v in theirs.items() if isinstance(v, float)}
    best_cache = min(numeric, key=numeric.get)
    tokens = batch * _NEW_TOKENS.value
    row = dict(batch=batch, kvpage_tokens_per_s=tokens / ours["wall_s"],
               hf_tokens_per_s=tokens / numeric[best_cache], hf_best_cache=best_cache,
               hf_seconds=theirs, kvpage=ours, kvpage_sync=sync,
               kvpage_sync_tokens_per_s=tokens / sync["wall_s"], recompiles=recompiles)
    row["ratio"] = row["kvpage_tokens_per_s"] / row["hf_tokens_per_s"]
    rows.append(row)
    steps = ours["num_steps"]
    print(f"{batch:>5} {row['kvpage_tokens_per_s']:>13.0f} {row['hf_tokens_per_s']:>10.0f} "
          f"{best_cache:>9} {row['ratio']:>6.2f} {1e3 * ours['step_s'] / steps:>8.2f} "
          f"{1e3 * ours['wall_s'] / steps:>9.2f} {ours['host_added']:>8.1%} "
          f"{row['kvpage_sync_tokens_per_s']:>10.0f} {sync['host_added']:>8.1%} "
          f"{recompiles:>10}")
  record = dict(benchmark="decode_cpu", premises=dict(
      model=model_config.name, dims={k: model_config[k] for k in (
          "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "ffn_dim",
          "vocab_size")}, dtype="fp32", prompt_len=_PROMPT_LEN.value,
      new_tokens=_NEW_TOKENS.value, page_size=_PAGE_SIZE.value, sampling="greedy",
      batch_policy="all prompts submitted at once; continuous batching, chunked prefill; "
      "kvpage async scheduling (sync run reported beside it)",
      attention_impl=model_config.attention_impl,
      repeats=_REPEATS.value, torch_threads=torch.get_num_threads(),
      **premises.environment()), rows=rows)
  with open(_OUT.value, "w") as f:
    json.dump(record, f, indent=2)
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  cli.run(main)
