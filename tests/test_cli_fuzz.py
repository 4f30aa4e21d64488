"""Random flag values: every entry point either runs or prints one `error:` line.

Hypothesis picks a flag (or a config override) and a value from the kinds that break
programs — negative, zero, huge, inf, nan, non-numeric, malformed specs, unknown
keys — and runs the entry point in-process (`cli_harness.Worker`). A run may succeed;
if it fails, its exit status is not 0 and stderr is exactly one line starting with
`error:`, and not one naming an internal error: bad input must be recognised as
such. A run that does not end within the worker's time limit fails the test.
"""

import pytest
from cli_harness import Worker, assert_one_error_line
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

NUMBERS = ["0", "-1", "1", "2", "3", "16", "-0", "1e9", "1e300", "-1e300", "inf", "-inf",
           "nan", "1.5", "0.5", "123456789012345678901234", "1000000000000", "0x10", "",
           "abc", "1,2", ":", "true"]
SPECS = ["uniform:1:inf", "uniform:5:1", "uniform:1", "uniform:a:b", "mix:0.5:inf:1",
         "mix:2:3:4", "mix:0.5:3:4", "lognormal:1e300:inf", "lognormal:4:8", "lognormal:0:1",
         "zipf:1", "uniform:-3:4", "uniform:1:nan", "uniform:1e9:1e10", "gamma:2", "gamma:inf",
         "gamma:1e-200", "gamma:nan", "gamma:", "poisson", "uniform:1.5:2"]
VALUES = st.one_of(st.sampled_from(NUMBERS + SPECS), st.integers(-10**25, 10**25).map(str),
                   st.floats(allow_nan=True, allow_infinity=True).map(repr),
                   st.text(max_size=12).filter(lambda t: "\x00" not in t))
FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck))

SERVE_FLAGS = ["num_requests", "arrival_rate", "arrival_process", "prompt_len", "output_len",
               "priority", "seed", "num_pages", "page_size", "num_host_pages", "eos_token_id",
               "slo_ttft", "slo_tpot", "hardware", "prefill_policy", "chunk_size",
               "preemption_mode", "max_num_seqs", "max_num_batched_tokens", "max_waiting",
               "watermark", "output_estimate", "num_decode_steps", "config.scheduler.watermark",
               "config.scheduler.max_num_seqs", "config.scheduler.nope", "config.model.nope",
               "config.model.max_seq_len", "config.model.vocab_size", "config.model.num_layers",
               "config.model.rope_theta", "config.cache.page_size", "config.nope",
               "config.scheduler.step_cost_window", "config.scheduler.output_estimate"]
GENERATE_FLAGS = ["prompt_ids", "max_new_tokens", "page_size", "chunk_size", "temperature",
                  "top_k", "top_p", "seed", "attention_impl", "config.model.max_seq_len",
                  "config.model.vocab_size", "config.model.norm_eps", "config.nope",
                  "config.scheduler.max_num_seqs"]
CAPACITY_FLAGS = ["seq_len", "dtype", "kv_dtype", "page_size", "memory_gb", "weights_gb",
                  "reserve_gb", "units", "hardware", "config.model.num_kv_heads",
                  "config.model.head_dim", "config.model.num_layers", "config.cache.kv_dtype",
                  "config.model.dtype", "config.nope"]


# Flags that size the work: a large valid value is a long run, not a hang, so these
# draw only from the fixed list, whose valid values are small.
SIZES = ("num_requests", "max_new_tokens", "output_len", "max_num_seqs",
         "config.scheduler.max_num_seqs")


def fuzzed(flag_names: list[str]) -> st.SearchStrategy[list[str]]:
  """One to three `--flag=value` arguments."""
  def value_for(name: str) -> st.SearchStrategy[str]:
    return st.sampled_from(NUMBERS + SPECS) if name in SIZES else VALUES

  one = st.sampled_from(flag_names).flatmap(
      lambda name: value_for(name).map(lambda value: f"--{name}={value}"))
  return st.lists(one, min_size=1, max_size=3)


def check(worker: Worker, argv: list[str]) -> None:
  rc, stderr = worker.run(argv)
  if rc != 0 or stderr.strip():
    assert_one_error_line(rc, stderr, argv)


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
  cache = tmp_path_factory.mktemp("jax_cache")
  started = {"serve_bench": Worker("serve_bench", time_limit_s=30),
             "generate": Worker("generate", time_limit_s=120, cache_dir=str(cache)),
             "capacity": Worker("capacity", time_limit_s=30)}
  yield started
  for worker in started.values():
    worker.close()


def test_serve_bench_fuzz(workers, tmp_path):
  @FUZZ
  @given(fuzzed(SERVE_FLAGS))
  def run(flags):
    # The simulator and a handful of short requests keep a valid run to milliseconds.
    argv = ["--config=configs/tiny.py", "--executor=sim", "--num_requests=3",
            "--prompt_len=uniform:1:40", "--output_len=uniform:1:8",
            f"--workdir={tmp_path}/run", *flags]
    check(workers["serve_bench"], argv)

  run()


def test_generate_fuzz(workers):
  @settings(FUZZ, max_examples=30)
  @given(fuzzed(GENERATE_FLAGS))
  def run(flags):
    # One short prompt, two new tokens, two layers: a valid run reuses the cached
    # compiled steps, and one that changes a shape compiles a small program.
    argv = ["--config=configs/tiny.py", "--config.model.num_layers=2", "--prompt_ids=1,2,3",
            "--max_new_tokens=2", *flags]
    check(workers["generate"], argv)

  run()


def test_capacity_fuzz(workers):
  @FUZZ
  @given(fuzzed(CAPACITY_FLAGS))
  def run(flags):
    check(workers["capacity"], ["--config=configs/llama_13b.py", *flags])

  run()
