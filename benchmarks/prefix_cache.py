r"""Prefix caching: prefill tokens computed, TTFT and admissions, caching off and on.

  python -m benchmarks.prefix_cache --out=prefix_cache.json

The workload of the prefix-caching issue: N requests, each one of 8 shared prefixes of
1,024 tokens (`--shared_prefix=1024:8`: a system prompt, a few-shot preamble) followed
by a unique suffix of U tokens, at a fixed arrival rate, through `serve_bench`'s own
run (`experiments.serve_bench.run_bench`), once with `cache.prefix_caching` off and
once on. Without caching every request computes its 1,024 + U prompt tokens; with it,
ideally only the first request of each group computes the prefix, so about
8 x 1,024 + N x U tokens, plus what eviction forces back (reported) and what
recompute preemption redoes.

Two setups:
  1. **Real, on this machine**: the tiny Llama (fp32, random weights, greedy) on CPU,
     a pool of `--tiny_pages` pages of 16 tokens.
  2. **Simulated**: Llama 2 13B fp16 on an A100-80GB (the shipped `llama_13b` config,
     its memory-plan pool and calibrated or template step rates).

Each prints: prompt tokens computed against both formulas, the hit rate, pages
evicted, TTFT p50/p99, requests admitted (the rest answered 503/429) and finished.
Writes JSON with the premises (model, lengths, rate, pool, versions).
"""

import json

import ml_collections
from absl import app, flags

from configs import llama_13b, tiny
from experiments import serve_bench
from kvpage import premises

_OUT = flags.DEFINE_string("out", "prefix_cache.json", "Where to write the JSON record.")
_PREFIX = flags.DEFINE_integer("prefix_tokens", 1024, "Tokens of each shared prefix.")
_GROUPS = flags.DEFINE_integer("groups", 8, "Distinct shared prefixes.")
_TINY_REQUESTS = flags.DEFINE_integer("tiny_requests", 64, "Requests of the real run.")
_TINY_SUFFIX = flags.DEFINE_integer("tiny_suffix", 64, "Unique suffix tokens (real run).")
_TINY_OUTPUT = flags.DEFINE_integer("tiny_output", 16, "Output tokens (real run).")
_TINY_RATE = flags.DEFINE_string("tiny_rate", "8", "Arrivals/s (real run).")
_TINY_PAGES = flags.DEFINE_integer("tiny_pages", 640, "KV pages of the real run's pool.")
_SIM_REQUESTS = flags.DEFINE_integer("sim_requests", 800, "Requests of the 13B simulation.")
_SIM_SUFFIX = flags.DEFINE_integer("sim_suffix", 256, "Unique suffix tokens (13B).")
_SIM_OUTPUT = flags.DEFINE_integer("sim_output", 128, "Output tokens (13B).")
_SIM_RATE = flags.DEFINE_string("sim_rate", "4",
                                "Arrivals/s (13B): about what it serves without caching.")


def run(config: ml_collections.ConfigDict, caching: bool) -> dict:
  config = ml_collections.ConfigDict(config.to_dict())
  config.cache.prefix_caching = caching
  summary, _ = serve_bench.run_bench(config, show_progress=False)
  cache = summary["prefix_cache"]
  return dict(prefix_caching=caching, prefill_tokens_computed=summary["prefill_tokens_computed"],
              recomputed_tokens=summary["recomputed_tokens"],
              hit_tokens=cache.get("hit_tokens", 0), hit_rate=cache.get("hit_rate", 0.0),
              evicted_pages=cache.get("evicted_pages", 0),
              ttft_p50_s=summary["ttft_s"]["p50"], ttft_p99_s=summary["ttft_s"]["p99"],
              num_admitted=summary["num_admitted"], num_finished=summary["num_finished"],
              num_rejected=summary["num_rejected"], num_preemptions=summary["num_preemptions"],
              pages_total=summary["pages_total"], duration_s=summary["duration_s"])


def case(name: str, config: ml_collections.ConfigDict, suffix: int) -> dict:
  settings = serve_bench.BenchSettings.from_config(config)
  num, prefix, groups = settings.num_requests, _PREFIX.value, _GROUPS.value
  runs = [run(config, caching) for caching in (False, True)]
  return dict(name=name, model=config.model.name, num_requests=num, prefix_tokens=prefix,
              groups=groups, suffix_tokens=suffix, output_tokens=int(settings.output_len),
              arrival_rate=settings.arrival_rate, executor=settings.executor,
              without_sharing=num * (prefix + suffix), ideal=groups * prefix + num * suffix,
              runs=runs)


def _ms(seconds: float | None) -> str:
  return "n/a" if seconds is None else f"{1e3 * seconds:,.1f}"


def main(argv: list[str]) -> None:
  del argv  # Unused.
  shared = f"{_PREFIX.value}:{_GROUPS.value}"
  tiny_config = tiny.get_config()
  tiny_config.cache.num_pages = _TINY_PAGES.value
  tiny_config.bench.update(dict(
      executor="jax", num_requests=_TINY_REQUESTS.value, arrival_rate=_TINY_RATE.value,
      prompt_len=str(_TINY_SUFFIX.value), output_len=str(_TINY_OUTPUT.value),
      shared_prefix=shared))
  sim_config = llama_13b.get_config()
  sim_config.bench.update(dict(
      executor="sim", num_requests=_SIM_REQUESTS.value, arrival_rate=_SIM_RATE.value,
      prompt_len=str(_SIM_SUFFIX.value), output_len=str(_SIM_OUTPUT.value),
      shared_prefix=shared))
  cases = [case("real tiny, CPU", tiny_config, _TINY_SUFFIX.value),
           case("simulated Llama 2 13B, A100-80GB", sim_config, _SIM_SUFFIX.value)]
  for c in cases:
    print(f"\n{c['name']}: {c['num_requests']} requests at {c['arrival_rate']}/s, prefix "
          f"{c['prefix_tokens']} x {c['groups']} groups, suffix {c['suffix_tokens']}, output "
          f"{c['output_tokens']}; N x (prefix + U) = {c['without_sharing']:,}, "
          f"groups x prefix + N x U = {c['ideal']:,}")
    print(f"{'caching':>8} {'prefill computed':>17} {'recomputed':>11} {'hit rate':>9} "
          f"{'evicted':>8} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'admitted':>9} "
          f"{'finished':>9} {'preempted':>10}")
    for r in c["runs"]:
      print(f"{'on' if r['prefix_caching'] else 'off':>8} {r['prefill_tokens_computed']:>17,} "
            f"{r['recomputed_tokens']:>11,} {r['hit_rate']:>9.1%} {r['evicted_pages']:>8,} "
            f"{_ms(r['ttft_p50_s']):>12} {_ms(r['ttft_p99_s']):>12} {r['num_admitted']:>9} "
            f"{r['num_finished']:>9} {r['num_preemptions']:>10}")
  record = dict(premises=dict(
      real=dict(config="configs/tiny.py", dtype="fp32", greedy=True, page_size=16,
                num_pages=_TINY_PAGES.value),
      simulated=dict(config="configs/llama_13b.py", hardware="a100_80gb"),
      environment=premises.environment()), cases=cases)
  with open(_OUT.value, "w") as f:
    json.dump(record, f, indent=2)
  print(f"\nwrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
