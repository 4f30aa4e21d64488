r"""End-to-end CPU throughput matrix: kvpage's Engine vs Hugging Face `generate`, same weights.

  python -m benchmarks.decode_cpu --out=decode_cpu.json               # the three target cells
  python -m benchmarks.decode_cpu --config=configs/small.py --repeats=2
  python -m benchmarks.decode_cpu --batch=1,8,32 --prompt_len=32 --output_len=64

Builds a random `LlamaForCausalLM` with the config's dimensions, saves it, and loads the
same weights into kvpage. A cell is (batch, prompt, output): `--batch`, `--prompt_len`
and `--output_len` are lists read position by position (a one-value list repeats), or
crossed with `--product`. In every cell all prompts are submitted at once, greedy, and
each sequence generates exactly `output` tokens. The contenders, each warmed up first
(every program compiled), then timed round-robin `--repeats` times:
  * kvpage `default`: `Engine.generate` with the scheduler settings a user gets (async
    scheduling, chunked prefill, token budget 2,048, one decode per launch);
  * kvpage `N-step`: the same with multi-step decoding (`scheduler.num_decode_steps=N`)
    for each N of `--num_decode_steps`; the best of them is the "best multi-step";
  * kvpage `prefill`: the default engine generating one token per prompt, i.e. the
    prompts' prefill (plus one sample) through the whole engine;
  * kvpage `N replicas` (`--replicas`): N default engines over the same weights, each
    with a pool sized for its share, stepping at once from N threads
    (`kvpage.host.replicas`): data parallelism, a deployment choice beside the
    scheduler's defaults, not one of them;
  * HF `generate` with its dynamic and its static cache (`attn_implementation="sdpa"`,
    torch on `--torch_threads` threads); the faster is "HF best";
  * HF `forward`: one forward pass over the same prompts (what `generate` prefills).
Reported per contender: the best and the median of the rounds. Generated tokens/s =
batch x output / wall (prefill included for both); prefill tokens/s = prompt tokens /
wall. kvpage's `decode ms/step` is the executor alone replaying the default engine's
decode-only launches back to back (the host's share is engine wall minus replay).
The timed rounds must compile nothing: a recompilation raises. Peak RSS (the whole
process so far, both frameworks) is read after each cell. Requires the `test` extra.
"""

import itertools
import json
import pathlib
import resource
import statistics
import tempfile
import time

import jax
import numpy as np
import torch
import transformers
from absl import flags
from ml_collections import config_flags

from experiments import cli
from kvpage import batch as batch_lib
from kvpage import build, premises, sizing
from kvpage.device import backends
from kvpage.device import cache as paged_cache
from kvpage.device.backends.cpu import native as cpu_kernel
from kvpage.request import SamplingParams
from models import hf, llama

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "Model dimensions.")
_BATCH = flags.DEFINE_list("batch", ["64", "32", "32"], "Sequences per cell.")
_PROMPT_LEN = flags.DEFINE_list("prompt_len", ["64", "512", "1920"], "Prompt tokens per "
                                "sequence, per cell.")
_OUTPUT_LEN = flags.DEFINE_list("output_len", ["64", "128", "128"], "Generated tokens per "
                                "sequence, per cell.")
_PRODUCT = flags.DEFINE_bool("product", False, "Cross the three lists instead of reading "
                             "them position by position.")
_DECODE_STEPS = flags.DEFINE_list("num_decode_steps", ["4", "16"], "Multi-step kvpage "
                                  "engines to run beside the default (empty: none).")
_REPLICAS = flags.DEFINE_integer("replicas", 2, "Engines of the data-parallel contender "
                                  "(`kvpage.host.replicas`); below 2: none.")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per KV page.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed rounds; each contender runs once a round.")
_TORCH_THREADS = flags.DEFINE_integer("torch_threads", 2, "torch intra-op threads.")
_OUT = flags.DEFINE_string("out", "decode_cpu.json", "Where to write the JSON record.")

_BACKEND_COMPILES = []  # every XLA compilation in this process (jax.monitoring)


def _count_compiles(event: str, seconds: float, **kwargs) -> None:
  del seconds, kwargs  # Unused.
  if event == "/jax/core/compile/backend_compile_duration":
    _BACKEND_COMPILES.append(event)


def cells(batches: list[str], prompts: list[str], outputs: list[str],
          product: bool) -> list[tuple[int, int, int]]:
  """`(batch, prompt, output)` cells from the three flag lists."""
  lists = [list(map(int, values)) for values in (batches, prompts, outputs)]
  if product:
    return list(itertools.product(*lists))
  size = max(map(len, lists))
  if any(len(values) not in (1, size) for values in lists):
    raise ValueError(f"--batch, --prompt_len and --output_len need equal lengths (or one "
                     f"value) without --product; got {', '.join(str(len(v)) for v in lists)}")
  return [tuple(values[i % len(values)] for values in lists) for i in range(size)]


def save_random_checkpoint(model_config, directory: pathlib.Path) -> None:
  hf_config = transformers.LlamaConfig(
      vocab_size=model_config.vocab_size, hidden_size=model_config.d_model,
      intermediate_size=model_config.ffn_dim, num_hidden_layers=model_config.num_layers,
      num_attention_heads=model_config.num_heads, num_key_value_heads=model_config.num_kv_heads,
      head_dim=model_config.head_dim, max_position_embeddings=model_config.max_seq_len,
      rms_norm_eps=model_config.norm_eps, rope_theta=model_config.rope_theta,
      tie_word_embeddings=model_config.tie_embeddings)
  torch.manual_seed(0)
  transformers.LlamaForCausalLM(hf_config).save_pretrained(directory)


def run_choices(model_config) -> str:
  """How kvpage's model runs (`kvpage.device.backends.RunChoices`), for a run's header."""
  m = model_config
  return (f"kvpage attention {m.attention_impl}, linear {m.linear_impl} at matmul precision "
          f"{m.get('matmul_precision', 'default')} (CPU kernels: {cpu_kernel.status()}; "
          f"AMX: {'yes' if cpu_kernel.amx() else 'no'})")


def load_kvpage(config, directory: pathlib.Path):
  """The checkpoint's model section and params into `config` (returns the params),
  keeping the config's name and its run choices (`kvpage.device.backends.RunChoices`), which the
  checkpoint's `config.json` does not carry."""
  name, chosen = config.model.name, config.model
  config.model, params = hf.load(directory)
  config.model.name = name
  backends.RunChoices.of(chosen).write(config.model)
  return params


def load_hf(directory: pathlib.Path, attn_implementation: str = "sdpa"):
  model = transformers.LlamaForCausalLM.from_pretrained(
      directory, attn_implementation=attn_implementation, dtype=torch.float32).eval()
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = 0
  return model


class Contender:
  """Something timed once per round: `run()` appends a wall time; `stats` sums them up."""

  def __init__(self):
    self.walls: list[float] = []

  def timed(self, fn) -> None:
    start = time.perf_counter()
    fn()
    self.walls.append(time.perf_counter() - start)

  def stats(self, work: int) -> dict:
    """Best and median wall, and `work` (tokens) per second at each."""
    best, median = min(self.walls), statistics.median(self.walls)
    return dict(best_s=best, median_s=median, best_tokens_per_s=work / best,
                median_tokens_per_s=work / median, walls_s=self.walls)


class RecordingStep:
  """Wraps the executor's jitted step to keep every batch it launches, for `replay_decodes`."""

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


class KvpageContender(Contender):
  """One engine generating `new_tokens` for every prompt, all submitted at once."""

  def __init__(self, engine, prompts, new_tokens, record: bool = True):
    super().__init__()
    self.engine, self.prompts = engine, prompts
    self.sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    self.recording = None
    if record:  # keep the launches, for `replay_decodes`
      self.recording = engine.executor.step = RecordingStep(engine.executor.step)
    self.run()  # warm-up: compiles every program this run uses
    self.walls = []

  def run(self) -> None:
    if self.recording:
      self.recording.records = []
    launches = self.engine.executor.num_launches
    self.timed(lambda: self._check(self.engine.generate(self.prompts, self.sampling)))
    self.num_launches = self.engine.executor.num_launches - launches
    if self.recording:  # this run's launches only (another contender may share the engine)
      self.records = self.recording.records

  def _check(self, requests) -> None:
    if any(len(r.output_ids) != self.sampling.max_tokens for r in requests):
      raise RuntimeError("kvpage generated the wrong number of tokens")

  def replay_decodes(self) -> dict:
    """The last run's decode-only launches through the jitted step alone, back to back."""
    executor, step = self.engine.executor, self.recording.step
    decodes = [r for r in self.records
               if isinstance(r[0], batch_lib.DecodeStepBatch)]
    feed, iterations = None, 0
    start = time.perf_counter()
    for batch, all_greedy, num_steps in decodes:
      if num_steps > 1:
        samples, feed, executor.cache = step.dispatch_multi(
            executor.params, executor.cache, batch, all_greedy, feed, num_steps)
        iterations += int(np.max(batch.num_steps))
      else:
        samples, executor.cache = step.dispatch(executor.params, executor.cache, batch,
                                                all_greedy, feed)
        feed, iterations = samples, iterations + 1
      np.asarray(samples)
    seconds = time.perf_counter() - start
    return dict(decode_launches=len(decodes), decode_iterations=iterations,
                decode_ms_per_step=1e3 * seconds / max(iterations, 1),
                launches=len(self.records))


class ReplicasContender(Contender):
  """`Replicas.generate` over all prompts (each engine warmed up by a first run)."""

  def __init__(self, replicas, prompts, new_tokens):
    super().__init__()
    self.replicas, self.prompts = replicas, prompts
    self.sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    self.run()  # warm-up: compiles every program each engine uses
    self.walls = []

  def run(self) -> None:
    def generate():
      requests = self.replicas.generate(self.prompts, self.sampling)
      if any(len(r.output_ids) != self.sampling.max_tokens for r in requests):
        raise RuntimeError("kvpage replicas generated the wrong number of tokens")

    self.timed(generate)


class HfGenerate(Contender):
  """Batched greedy `generate` with one cache implementation; `error` if it cannot run."""

  def __init__(self, model, prompts, new_tokens, cache):
    super().__init__()
    self.model, self.inputs, self.error = model, torch.tensor(prompts), None
    self.kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if cache == "static":
      self.kwargs["cache_implementation"] = "static"
    try:
      self.run()  # warm-up
    except Exception as error:  # an unsupported cache in this transformers version
      self.error = f"n/a: {type(error).__name__}: {error}"
    self.walls = []

  def run(self) -> None:
    if not self.error:
      with torch.inference_mode():
        self.timed(lambda: self.model.generate(self.inputs, **self.kwargs))


class HfForward(Contender):
  """One forward pass over all prompts (with a cache, as `generate` prefills)."""

  def __init__(self, model, prompts):
    super().__init__()
    self.model, self.inputs = model, torch.tensor(prompts)
    self.run()  # warm-up
    self.walls = []

  def run(self) -> None:
    with torch.inference_mode():
      self.timed(lambda: self.model(self.inputs, use_cache=True))


def run_cell(config, params, hf_model, batch: int, prompt: int, output: int,
             rng: np.random.Generator) -> dict:
  prompts = rng.integers(1, config.model.vocab_size, (batch, prompt)).tolist()
  num_pages = sizing.pages_for_work(config, [prompt + output] * batch)  # as serve_bench sizes it
  modes = {"default": 1, **{f"{n}-step": n for n in map(int, _DECODE_STEPS.value)}}
  kvpage = {}
  for mode, decode_steps in modes.items():
    scheduler_config = config.scheduler.copy_and_resolve_references()  # one per engine
    scheduler_config.num_decode_steps = decode_steps
    engine = build.jax_engine(llama, config.model, params, scheduler_config, num_pages=num_pages,
                              page_size=config.cache.page_size,
                              kv_dtype=config.cache.kv_dtype)
    kvpage[mode] = KvpageContender(engine, prompts, output)
  kvpage["prefill"] = KvpageContender(kvpage["default"].engine, prompts, 1, record=False)
  replicas = None
  if _REPLICAS.value >= 2:
    share = -(-batch // _REPLICAS.value)  # the most prompts one engine gets
    replicas = ReplicasContender(build.jax_replicas(llama,
        config.model, params, config.scheduler, replicas=_REPLICAS.value,
        num_pages=sizing.pages_for_work(config, [prompt + output] * share),
        page_size=config.cache.page_size, kv_dtype=config.cache.kv_dtype), prompts, output)
  theirs = {cache: HfGenerate(hf_model, prompts, output, cache)
            for cache in ("dynamic", "static")}
  theirs["forward"] = HfForward(hf_model, prompts)
  contenders = [*kvpage.values(), *([replicas] if replicas else []), *theirs.values()]
  compiles_before = len(_BACKEND_COMPILES)
  # Round-robin: this VM's speed drifts, so timing the contenders in separate phases
  # would compare different machines.
  for _ in range(_REPEATS.value):
    for contender in contenders:
      contender.run()
  recompiles = len(_BACKEND_COMPILES) - compiles_before
  if recompiles:
    raise RuntimeError(f"{recompiles} XLA compilations during the timed rounds of cell "
                       f"{(batch, prompt, output)}: a shape escaped the warm-up")
  generated, prompt_tokens = batch * output, batch * prompt
  row = dict(batch=batch, prompt_len=prompt, output_len=output, num_pages=num_pages,
             kv_pool_bytes=paged_cache.pool_bytes(config.model, num_pages=num_pages,
                                                  page_size=config.cache.page_size,
                                                  dtype=config.cache.kv_dtype),
             recompiles=recompiles)
  row["kvpage"] = {mode: {**kvpage[mode].stats(generated), **kvpage[mode].replay_decodes()}
                   for mode in modes}
  row["kvpage_prefill"] = kvpage["prefill"].stats(prompt_tokens)
  row["kvpage_replicas"] = (dict(replicas=_REPLICAS.value, **replicas.stats(generated))
                            if replicas else None)
  row["hf"] = {cache: (theirs[cache].error or theirs[cache].stats(generated))
               for cache in ("dynamic", "static")}
  row["hf_forward"] = theirs["forward"].stats(prompt_tokens)
  usable = {cache: stats for cache, stats in row["hf"].items() if isinstance(stats, dict)}
  hf_cache = max(usable, key=lambda cache: usable[cache]["best_tokens_per_s"])
  hf_best = usable[hf_cache]["best_tokens_per_s"]
  multi = [mode for mode in modes if mode != "default"]
  best_multi = max(multi, key=lambda m: row["kvpage"][m]["best_tokens_per_s"], default=None)
  row.update(
      hf_best_cache=hf_cache, hf_best_tokens_per_s=hf_best,
      ratio_default=row["kvpage"]["default"]["best_tokens_per_s"] / hf_best,
      best_multi_step=best_multi,
      ratio_best_multi_step=(row["kvpage"][best_multi]["best_tokens_per_s"] / hf_best
                             if best_multi else None),
      ratio_replicas=(row["kvpage_replicas"]["best_tokens_per_s"] / hf_best
                      if replicas else None),
      ratio_prefill=row["kvpage_prefill"]["best_tokens_per_s"]
      / row["hf_forward"]["best_tokens_per_s"],
      peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
  return row


def format_row(row: dict) -> str:
  ours, default = row["kvpage"], row["kvpage"]["default"]
  multi = row["best_multi_step"]
  multi_text = (f"{ours[multi]['best_tokens_per_s']:>7.0f} ({multi:>7}) "
                f"{row['ratio_best_multi_step']:>5.2f}" if multi else f"{'-':>23}")
  replicas = row.get("kvpage_replicas")
  replicas_text = (f"{replicas['best_tokens_per_s']:>8.0f} {row['ratio_replicas']:>5.2f}"
                   if replicas else f"{'-':>14}")
  return (f"{row['batch']:>5} {row['prompt_len']:>6} {row['output_len']:>6} "
          f"{default['best_tokens_per_s']:>7.0f} {default['median_tokens_per_s']:>7.0f} "
          f"{row['hf_best_tokens_per_s']:>7.0f} {row['hf_best_cache']:>7} "
          f"{row['ratio_default']:>5.2f} {multi_text} {replicas_text} "
          f"{row['kvpage_prefill']['best_tokens_per_s']:>8.0f} "
          f"{row['hf_forward']['best_tokens_per_s']:>8.0f} {row['ratio_prefill']:>5.2f} "
          f"{default['decode_ms_per_step']:>7.2f} {row['peak_rss_bytes'] / 2**30:>6.2f}")


HEADER = (f"{'batch':>5} {'prompt':>6} {'output':>6} {'kvpage':>7} {'median':>7} "
          f"{'HF':>7} {'cache':>7} {'ratio':>5} {'best multi-step':>17} {'ratio':>5} "
          f"{'replicas':>8} {'ratio':>5} "
          f"{'prefill':>8} {'HF fwd':>8} {'ratio':>5} {'dec ms':>7} {'RSS GiB':>6}")


def main(argv: list[str]) -> None:
  del argv  # Unused.
  jax.monitoring.register_event_duration_secs_listener(_count_compiles)
  torch.set_num_threads(_TORCH_THREADS.value)
  config = cli.load_config(_CONFIG)
  config.cache.page_size = _PAGE_SIZE.value
  plan = cells(_BATCH.value, _PROMPT_LEN.value, _OUTPUT_LEN.value, _PRODUCT.value)
  longest = max(prompt + output for _, prompt, output in plan)
  if longest > config.model.max_seq_len:
    raise ValueError(f"a cell needs {longest:,} positions; {config.model.name} has "
                     f"{config.model.max_seq_len:,}")
  with tempfile.TemporaryDirectory() as directory:
    save_random_checkpoint(config.model, pathlib.Path(directory))
    hf_model = load_hf(pathlib.Path(directory))
    params = load_kvpage(config, pathlib.Path(directory))
  m = config.model
  print(f"kvpage vs HF generate: {m.name} ({m.num_layers} layers, d_model {m.d_model}, "
        f"{m.num_heads}/{m.num_kv_heads} heads x {m.head_dim}, vocab {m.vocab_size}), fp32 "
        f"weights, {config.cache.kv_dtype} KV cache, {run_choices(m)}, greedy, all "
        f"prompts at once, page size {config.cache.page_size}, CPU, torch "
        f"{torch.get_num_threads()} threads, HF attention "
        f"{hf_model.config._attn_implementation}; best of {_REPEATS.value} rounds "
        "(tokens/s); ratios: kvpage / HF best")
  print(HEADER)
  rng = np.random.default_rng(0)
  rows = []
  for batch, prompt, output in plan:
    rows.append(run_cell(config, params, hf_model, batch, prompt, output, rng))
    print(format_row(rows[-1]), flush=True)
  record = dict(benchmark="decode_cpu", premises=dict(
      model=m.name, dims={k: m[k] for k in (
          "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "ffn_dim",
          "vocab_size")}, dtype="fp32", kv_dtype=config.cache.kv_dtype, cells=plan,
      page_size=config.cache.page_size,
      sampling="greedy, ignore_eos", batch_policy="all prompts submitted at once; kvpage: "
      "default scheduler (continuous batching, chunked prefill, async scheduling), pool "
      "sized for the whole batch above the watermark; multi-step engines: "
      f"{', '.join(_DECODE_STEPS.value) or 'none'}; replicas: "
      f"{_REPLICAS.value if _REPLICAS.value >= 2 else 'none'} (each pool sized for its "
      "share, prompts spread by KV pages promised)",
      scheduler=config.scheduler.to_dict(), attention_impl=m.attention_impl,
      linear_impl=m.linear_impl, matmul_precision=m.get("matmul_precision", "default"),
      cpu_kernels=cpu_kernel.status(), amx=cpu_kernel.amx(),
      hf_attention=hf_model.config._attn_implementation, repeats=_REPEATS.value,
      torch_threads=torch.get_num_threads(), **premises.environment()), rows=rows)
  with open(_OUT.value, "w") as f:
    json.dump(record, f, indent=2)
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  cli.run(main)
