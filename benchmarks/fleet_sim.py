r"""How fast the simulated fleet runs, and what each routing policy does at its door.

  python -m benchmarks.fleet_sim --out=fleet_sim.json     # 64 replicas x 2,000 requests

`--replicas` simulated Llama-2-13B replicas on A100-80GB (fp16, context raised to 16,384
tokens; each `--num_pages` KV pages of 16 tokens, the 13B setup's pool; the scheduler's
defaults, watermark 0.15)
behind one door (`kvpage.sim.fleet.replay_fleet`), one run per routing policy over the
same trace: `--num_requests` Poisson arrivals at `--rate` req/s, prompts
`mix:0.1:8000:50` (one in ten is 8,000 tokens), outputs uniform 32-512 (ignore_eos),
users sharing `--shared_prefix` system prompts. Per policy: the wall time of the run
(the bar: under a minute at 64 x 2,000), requests refused by every replica, retries at
the door (first choices that refused), the prefix cache's hit rate, TTFT p50/p99 of
the served, and how unevenly the pools filled (max over mean of the replicas' peak KV
use). Prints a table and writes JSON with its premises.
"""

import json
import pathlib
import time

import numpy as np
from absl import flags

from configs import hardware as hardware_lib
from configs import llama_13b
from experiments import cli
from kvpage import build
from kvpage import premises as environment
from kvpage.host.routing import POLICIES, Router
from kvpage.request import SamplingParams
from kvpage.sim import fleet, workload

_OUT = flags.DEFINE_string("out", "fleet_sim.json", "Where to write the JSON record.")
_REPLICAS = flags.DEFINE_integer("replicas", 64, "Simulated replicas.")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 2000, "Requests of the trace.")
_RATE = flags.DEFINE_float("rate", 100.0, "Poisson arrivals, req/s, at the fleet's door.")
_NUM_PAGES = flags.DEFINE_integer("num_pages", 3881, "KV pages per replica (the 13B on an "
                                  "A100's pool at 16 tokens a page).")
_SHARED_PREFIX = flags.DEFINE_string("shared_prefix", "1024:8", "TOKENS:GROUPS shared "
                                     "system prompts ('' = none).")
_POLICIES = flags.DEFINE_list("policies", list(POLICIES), "Routing policies to run.")
_SEED = flags.DEFINE_integer("seed", 0, "Trace seed.")
CONTEXT = 16384  # the model's context, raised so the 8,000-token prompts fit


def run_policy(policy: str, trace: list) -> dict:
  config = llama_13b.get_config()
  config.model.max_seq_len = CONTEXT  # the long prompts must fit (the line study's choice)
  hardware = hardware_lib.get_hardware("a100_80gb")
  engines = {f"r{i}": build.sim_engine(config.model, hardware, config.scheduler,
                                       num_pages=_NUM_PAGES.value, page_size=16,
                                       prefix_caching=True)
             for i in range(_REPLICAS.value)}
  peak = dict.fromkeys(engines, 0.0)
  for name, engine in engines.items():  # each replica's highest KV use, step by step
    engine.on_step = lambda *_, name=name, engine=engine: peak.__setitem__(
        name, max(peak[name], engine.scheduler.page_pool.usage))
  start = time.perf_counter()
  out = fleet.replay_fleet(engines, Router(policy, headroom_margin_pages=200,
                                           wait_margin_s=1.0), trace,
                           make_sampling=lambda item: SamplingParams(
                               max_tokens=item.output_len, ignore_eos=True))
  wall = time.perf_counter() - start
  served = [a for a in out if a.request is not None]
  ttft = []
  for arrival in served:
    first = next((e.time for e in arrival.request.events if e.kind == "first_token"), None)
    if first is not None:
      ttft.append(first - arrival.request.arrival_time)
  stats = [e.scheduler.page_pool.prefix.stats for e in engines.values()]
  queried = sum(s.query_tokens for s in stats)
  peaks = np.array(list(peak.values()))
  return dict(policy=policy, wall_s=wall, served=len(served), refused=len(out) - len(served),
              door_retries=sum(len(a.routed.tried) - 1 for a in served),
              prefix_hit_rate=sum(s.hit_tokens for s in stats) / queried if queried else 0.0,
              ttft_p50_s=float(np.percentile(ttft, 50)) if ttft else None,
              ttft_p99_s=float(np.percentile(ttft, 99)) if ttft else None,
              pool_imbalance=float(peaks.max() / peaks.mean()) if peaks.mean() else None)


def main(argv: list[str]) -> None:
  del argv  # Unused.
  unknown = sorted(set(_POLICIES.value) - set(POLICIES))
  if unknown:
    raise ValueError(f"--policies: unknown {', '.join(unknown)}; choose from "
                     f"{', '.join(POLICIES)}")
  trace = workload.synthesize(num_requests=_NUM_REQUESTS.value, arrival_rate=_RATE.value,
                              prompt_len="mix:0.1:8000:50", output_len="uniform:32:512",
                              vocab_size=32000, seed=_SEED.value,
                              shared_prefix=_SHARED_PREFIX.value)
  rows = [run_policy(policy, trace) for policy in _POLICIES.value]
  premises = dict(model="llama2_13b fp16", hardware="a100_80gb (simulated)",
                  replicas=_REPLICAS.value, num_pages=_NUM_PAGES.value, page_size=16,
                  num_requests=_NUM_REQUESTS.value, rate=_RATE.value,
                  prompt_len="mix:0.1:8000:50", output_len="uniform:32:512",
                  shared_prefix=_SHARED_PREFIX.value, seed=_SEED.value, context=CONTEXT,
                  scheduler="the 13B config's defaults (watermark 0.15, chunked prefill 512)",
                  environment=environment.environment())
  print(f"simulated fleet: {_REPLICAS.value} x Llama-2-13B on A100 ({_NUM_PAGES.value:,} "
        f"pages each), {_NUM_REQUESTS.value:,} requests at {_RATE.value:g} req/s")
  print(f"{'policy':<16} {'wall s':>7} {'served':>7} {'refused':>8} {'retries':>8} "
        f"{'prefix hit':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'pool max/mean':>13}")
  for r in rows:
    ms = lambda s: "n/a" if s is None else f"{s:.2f} s"
    print(f"{r['policy']:<16} {r['wall_s']:>7.1f} {r['served']:>7} {r['refused']:>8} "
          f"{r['door_retries']:>8} {r['prefix_hit_rate']:>10.1%} {ms(r['ttft_p50_s']):>9} "
          f"{ms(r['ttft_p99_s']):>9} {r['pool_imbalance'] or 0:>13.2f}")
  out = pathlib.Path(_OUT.value)
  cli.write_files(out.parent, {out.name: json.dumps(dict(premises=premises, rows=rows),
                                                    indent=2)})
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  cli.run(main)
