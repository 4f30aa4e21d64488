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
kvpage runs in three modes, each its own engine on the same weights:
  * `async N-step`: async scheduling plus multi-step decoding
    (`scheduler.num_decode_steps = --num_decode_steps`): all-decode steps run N
    iterations per launch, each feeding its sample to the next on the device;
  * `async 1-step`: the defaults (step N+1 scheduled and launched while step N runs);
  * `sync 1-step`: schedule, launch, wait, in turn.
For each, the launches the engine made are replayed through the jitted step alone,
back to back: `replay ms` is that executor time per launch, `host +%` what the
engine's host work (scheduling, batch building, bookkeeping) adds to it (engine
wall / replay - 1). Compilations during the timed runs are counted (expected: 0).
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
from kvpage.host.request import SamplingParams
from kvpage.sim import premises
from models import hf

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "Model dimensions.")
_BATCHES = flags.DEFINE_list("batches", ["1", "8", "32"], "Batch sizes.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 32, "Prompt tokens per sequence.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 64, "Generated tokens per sequence.")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per KV page.")
_DECODE_STEPS = flags.DEFINE_integer(
    "num_decode_steps", 16, "Decode iterations per launch of the multi-step kvpage engine "
    "(scheduler.num_decode_steps); 1-step engines run beside it.")
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
    self.records.append((batch, all_greedy, 1))
    return self.step.dispatch(params, cache, batch, all_greedy, feed)

  def dispatch_multi(self, params, cache, batch, all_greedy, feed, num_steps):
    self.records.append((batch, all_greedy, num_steps))
    return self.step.dispatch_multi(params, cache, batch, all_greedy, feed, num_steps)


def replay_steps(executor, records) -> float:
  """Seconds the executor's step alone takes for `records`, back to back.

  Each launch is made and waited for (sampled ids to numpy), feeding the next from
  its output as the engine does: the engine's wall time minus this is what its host
  work (scheduling, batch building, bookkeeping) adds.
  """
  step = executor.step.step
  feed = None
  start = time.perf_counter()
  for batch, all_greedy, num_steps in records:
    if num_steps > 1:
      samples, feed, executor.cache = step.dispatch_multi(
          executor.params, executor.cache, batch, all_greedy, feed, num_steps)
    else:
      samples, executor.cache = step.dispatch(executor.params, executor.cache, batch,
                                              all_greedy, feed)
      feed = samples
    np.asarray(samples)
  return time.perf_counter() - start


class KvpageContender:
  """One engine: each `run()` times `generate`, then replays its batches (`replay_steps`)."""

  def __init__(self, engine, prompts, new_tokens):
    self.engine, self.prompts = engine, prompts
    self.sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    self.recording = engine.executor.step = RecordingStep(engine.executor.step)
    self.walls, self.steps, self.num_launches = [], [], 0
    self.run()  # warm-up: compiles every bucket this run uses
    self.walls, self.steps = [], []

  def run(self) -> None:
    self.recording.records = []
    launches_before = self.engine.executor.num_launches
    start = time.perf_counter()
    requests = self.engine.generate(self.prompts, self.sampling)
    self.walls.append(time.perf_counter() - start)
    if any(len(r.output_ids) != self.sampling.max_tokens for r in requests):
      raise RuntimeError("kvpage generated the wrong number of tokens")
    self.num_launches = self.engine.executor.num_launches - launches_before
    self.steps.append(replay_steps(self.engine.executor, self.recording.records))

  def result(self) -> dict:
    wall, step = min(self.walls), min(self.steps)
    return dict(wall_s=wall, step_s=step, host_added=wall / step - 1,
                num_launches=self.num_launches, walls_s=self.walls, replays_s=self.steps)


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
  print(f"{'batch':>5} {'kvpage mode':>16} {'tok/s':>7} {'HF tok/s':>8} {'HF cache':>8} "
        f"{'ratio':>5} {'launches':>8} {'replay ms':>9} {'engine ms':>9} {'host +%':>7} "
        f"{'recompiles':>10}")
  modes = {  # name -> (async scheduling, decode iterations per launch)
      f"async {_DECODE_STEPS.value}-step": (True, _DECODE_STEPS.value),
      "async 1-step": (True, 1), "sync 1-step": (False, 1)}
  for batch in map(int, _BATCHES.value):
    prompts = rng.integers(1, model_config.vocab_size, (batch, _PROMPT_LEN.value)).tolist()
    num_pages = 1 + batch * -(-(_PROMPT_LEN.value + _NEW_TOKENS.value) // _PAGE_SIZE.value)
    config.scheduler.watermark = 0.0  # an offline batch sized to fit: admit everything
    contenders = {}
    for mode, (async_scheduling, decode_steps) in modes.items():
      scheduler_config = config.scheduler.copy_and_resolve_references()  # one per engine
      scheduler_config.update(dict(async_scheduling=async_scheduling,
                                   num_decode_steps=decode_steps))
      engine = build.llama_engine(loaded_config, params, scheduler_config, num_pages=num_pages,
                                  page_size=_PAGE_SIZE.value)
      contenders[mode] = KvpageContender(engine, prompts, _NEW_TOKENS.value)
    for cache in ("dynamic", "static"):
      contenders[cache] = HfContender(hf_model, prompts, _NEW_TOKENS.value, cache)
    # Round-robin, best of `repeats` each: this VM's speed drifts, so timing the
    # contenders in separate phases would compare different machines.
    compiles_before = len(_BACKEND_COMPILES)
    for _ in range(_REPEATS.value):
      for contender in contenders.values():
        contender.run()
    recompiles = len(_BACKEND_COMPILES) - compiles_before
    theirs = {cache: contenders[cache].result() for cache in ("dynamic", "static")}
    numeric = {k: v for k, v in theirs.items() if isinstance(v, float)}
    best_cache = min(numeric, key=numeric.get)
    tokens = batch * _NEW_TOKENS.value
    hf_tokens_per_s = tokens / numeric[best_cache]
    for mode in modes:
      ours = contenders[mode].result()
      row = dict(batch=batch, mode=mode, kvpage_tokens_per_s=tokens / ours["wall_s"],
                 hf_tokens_per_s=hf_tokens_per_s, hf_best_cache=best_cache,
                 hf_seconds=theirs, kvpage=ours, recompiles=recompiles)
      row["ratio"] = row["kvpage_tokens_per_s"] / hf_tokens_per_s
      rows.append(row)
      launches = ours["num_launches"]
      print(f"{batch:>5} {mode:>16} {row['kvpage_tokens_per_s']:>7.0f} {hf_tokens_per_s:>8.0f} "
            f"{best_cache:>8} {row['ratio']:>5.2f} {launches:>8} "
            f"{1e3 * ours['step_s'] / launches:>9.2f} {1e3 * ours['wall_s'] / launches:>9.2f} "
            f"{ours['host_added']:>7.1%} {recompiles:>10}")
  record = dict(benchmark="decode_cpu", premises=dict(
      model=model_config.name, dims={k: model_config[k] for k in (
          "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "ffn_dim",
          "vocab_size")}, dtype="fp32", prompt_len=_PROMPT_LEN.value,
      new_tokens=_NEW_TOKENS.value, page_size=_PAGE_SIZE.value, sampling="greedy",
      batch_policy="all prompts submitted at once; continuous batching, chunked prefill; "
      f"kvpage modes: {', '.join(modes)}",
      attention_impl=model_config.attention_impl,
      repeats=_REPEATS.value, torch_threads=torch.get_num_threads(),
      **premises.environment()), rows=rows)
  with open(_OUT.value, "w") as f:
    json.dump(record, f, indent=2)
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  cli.run(main)
