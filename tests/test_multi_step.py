"""Multi-step decoding: several decode iterations per launch, samples fed on the device.

The tokens must be exactly those of one iteration per launch, greedy or seeded, with
or without async scheduling; what changes is only how many launches it takes and
when the host learns the tokens. These tests pin the cases where that could leak:
requests whose `max_tokens` ends mid-launch, stop tokens found at the end of a
launch, lookahead pages that do not fit, requests waiting to join, the simulator,
and compilation. Preemption is covered in test_engine_preemption.py.
"""

import pytest
import tiny_config
from engine_utils import run_streaming

from configs import hardware as hardware_lib
from configs import scheduler as scheduler_lib
from kvpage import build
from kvpage.host import scheduler_config as policy
from kvpage.host.scheduler import Scheduler
from kvpage.request import Request, SamplingParams
from models import llama

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9], [2, 7, 1, 8]]
# Not multiples of the launch length; 21 tokens cross a page boundary of 16.
MAX_TOKENS = [7, 21, 10]


@pytest.fixture(scope="module")
def params():
  return llama.random_init(tiny_config.get_config().model, seed=0)


def engine_for(params, *, num_decode_steps: int, async_scheduling: bool = True,
               num_pages: int = 64, attention_impl: str = "xla", **scheduler):
  config = tiny_config.get_config()
  config.model.attention_impl = attention_impl
  config.scheduler.update(dict(async_scheduling=async_scheduling, watermark=0.0,
                               num_decode_steps=num_decode_steps, **scheduler))
  engine = build.jax_engine(llama, config.model, params, config.scheduler, num_pages=num_pages,
                            page_size=16)
  engine.launches = []  # (num_steps, [each sequence's iterations]) of every launch
  engine.on_step = lambda output, new_tokens, finished: engine.launches.append(
      (output.num_steps, [seq.num_steps for seq in output.scheduled]))
  return engine


def generate(engine, samplings):
  requests = engine.generate(PROMPTS, samplings)
  bm = engine.scheduler.page_pool
  assert bm.num_free_pages == bm.num_usable_pages
  assert all(r.num_pending == 0 for r in requests)
  return requests


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_multi_step_greedy_tokens_equal_single_step(params, async_scheduling):
  samplings = [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
  single_engine = engine_for(params, num_decode_steps=1)
  single = generate(single_engine, samplings)
  engine = engine_for(params, num_decode_steps=4, async_scheduling=async_scheduling)
  multi = generate(engine, samplings)
  assert [r.output_ids for r in multi] == [r.output_ids for r in single]
  assert [len(r.output_ids) for r in multi] == MAX_TOKENS
  multi_launches = [steps for capacity, steps in engine.launches if capacity == 4]
  assert multi_launches, "no launch ran several iterations"
  # A request never runs past its max_tokens: 7 = prefill's 1 + 4 + 2.
  assert any(2 in steps for steps in multi_launches)
  assert all(max(steps) <= 4 for steps in multi_launches)
  assert len(engine.launches) < len(single_engine.launches) - 10


def test_multi_step_over_the_reference_attention_gives_the_same_tokens(params):
  samplings = [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
  single = generate(engine_for(params, num_decode_steps=1), samplings)
  oracle = generate(engine_for(params, num_decode_steps=4, attention_impl="reference"),
                    samplings)
  assert [r.output_ids for r in oracle] == [r.output_ids for r in single]


def test_multi_step_seeded_sampling_equals_single_step(params):
  samplings = [SamplingParams(max_tokens=n, temperature=0.8, top_k=50, top_p=0.9, seed=11,
                              ignore_eos=True) for n in MAX_TOKENS]
  single = generate(engine_for(params, num_decode_steps=1), samplings)
  multi = generate(engine_for(params, num_decode_steps=8), samplings)
  assert [r.output_ids for r in multi] == [r.output_ids for r in single]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_stop_token_mid_launch_voids_the_rest(params, async_scheduling):
  greedy = SamplingParams(max_tokens=16, ignore_eos=True)
  reference = generate(engine_for(params, num_decode_steps=1), greedy)
  stop = reference[1].output_ids[5]  # request 1 stops at its 6th token (or earlier)
  sampling = SamplingParams(max_tokens=16, stop_token_ids=(stop,))
  single = generate(engine_for(params, num_decode_steps=1), sampling)
  engine = engine_for(params, num_decode_steps=4, async_scheduling=async_scheduling)
  requests, outputs = run_streaming(engine, PROMPTS, sampling)
  assert [r.output_ids for r in requests] == [r.output_ids for r in single]
  assert [r.finish_reason for r in requests] == [r.finish_reason for r in single]
  assert requests[1].finish_reason == "stop" and requests[1].output_ids[-1] == stop
  for request in requests:  # each token streamed once, in order; one finished output
    mine = [o for o in outputs if o.request_id == request.request_id]
    assert [t for o in mine for t in o.new_token_ids] == request.output_ids
    assert [o.finished for o in mine] == [False] * (len(mine) - 1) + [True]
  bm = engine.scheduler.page_pool
  assert bm.num_free_pages == bm.num_usable_pages
  assert all(r.num_pending == 0 for r in requests)


def scheduler_for(num_decode_steps: int, num_pages: int = 32) -> Scheduler:
  config = scheduler_lib.get_scheduler_config()
  # Admission expects one output token, so a small pool still admits both requests.
  config.update(dict(num_decode_steps=num_decode_steps, watermark=0.0,
                     output_estimate="fixed", fixed_output_estimate=1))
  return Scheduler(config, num_pages=num_pages, page_size=4, max_model_len=64)


def prefill(scheduler: Scheduler, max_tokens=(9, 3)) -> list[Request]:
  requests = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=n))
              for i, n in enumerate(max_tokens)]
  for request in requests:
    assert scheduler.add_request(request).admitted
  out = scheduler.schedule()
  assert out.num_steps == 1 and all(seq.is_prefill for seq in out.scheduled)
  scheduler.update(out, {r.request_id: 7 for r in requests})
  return requests


def test_scheduler_plans_each_sequence_up_to_its_remaining_tokens():
  scheduler = scheduler_for(4)
  long, short = prefill(scheduler)
  out = scheduler.schedule()
  assert out.num_steps == 4
  assert [seq.num_steps for seq in out.scheduled] == [4, 2]  # short has 2 tokens left
  # Pages for every position the launch computes: 3 prompt + 1 + 4 - 1 = 7 tokens.
  assert len(long.page_ids) * 4 >= 3 + 4 and long.num_computed_tokens == 7
  assert long.num_pending == 4 and short.num_pending == 2
  with pytest.raises(ValueError, match="ran 4 decode iterations but 1 tokens came back"):
    scheduler.update(out, {"r0": 5, "r1": [5, 6]})
  finished = scheduler.update(out, {"r0": [5, 6, 7, 8], "r1": [5, 6]})
  assert finished == [short] and short.output_ids == [7, 5, 6]
  assert long.output_ids == [7, 5, 6, 7, 8] and long.num_pending == 0
  with pytest.raises(ValueError, match="applied twice"):
    scheduler.update(out, {"r0": [5, 6, 7, 8], "r1": [5, 6]})


def test_lookahead_pages_that_do_not_fit_leave_the_step_single():
  # 3 usable pages of 4 tokens: after prefill each request holds one, one is free,
  # and the launch would need a second page for each.
  scheduler = scheduler_for(4, num_pages=4)
  long, short = prefill(scheduler)
  out = scheduler.schedule()
  assert out.num_steps == 1 and [seq.num_steps for seq in out.scheduled] == [1, 1]
  assert not out.preempted and scheduler.page_pool.num_free_pages == 1
  assert long.num_pending == short.num_pending == 1


def test_a_waiting_request_keeps_steps_single():
  scheduler = scheduler_for(4)
  prefill(scheduler)
  # Room for no more running requests: the newcomer waits, so no launch may make it
  # wait several iterations longer.
  scheduler.config.max_num_seqs = 2
  assert scheduler.add_request(Request("late", [1, 2], SamplingParams(max_tokens=2))).admitted
  out = scheduler.schedule()
  assert out.num_steps == 1 and [seq.num_steps for seq in out.scheduled] == [1, 1]


def test_a_decode_left_out_by_the_token_budget_keeps_steps_single():
  scheduler = scheduler_for(4)
  prefill(scheduler)
  scheduler.config.max_num_batched_tokens = 1  # room for one of the two decodes
  out = scheduler.schedule()
  assert out.num_steps == 1 and [seq.num_steps for seq in out.scheduled] == [1]


def test_simulated_multi_step_runs_every_request_to_its_length():
  config = tiny_config.get_config()
  config.scheduler.update(dict(num_decode_steps=8, watermark=0.0))
  engine = build.sim_engine(config.model, hardware_lib.get_hardware("cpu"),
                            config.scheduler, num_pages=64, page_size=16)
  requests = engine.generate(PROMPTS, [SamplingParams(max_tokens=n, ignore_eos=True)
                                       for n in MAX_TOKENS])
  assert [len(r.output_ids) for r in requests] == MAX_TOKENS
  # One priced forward pass per iteration: prefill, then 20 decode iterations.
  assert len(engine.executor.costs) == 1 + max(MAX_TOKENS) - 1


def test_warmup_compiles_the_multi_step_programs(params):
  engine = engine_for(params, num_decode_steps=4)
  engine.executor.warmup(8, 64, num_decode_steps=4)
  compiles = engine.executor.num_compiles
  generate(engine, [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS])
  assert engine.executor.num_compiles == compiles


@pytest.mark.parametrize("value", [0, policy.MAX_DECODE_STEPS + 1, True])
def test_bad_num_decode_steps_is_rejected(value):
  config = scheduler_lib.get_scheduler_config()
  config.num_decode_steps = value
  with pytest.raises(ValueError, match="num_decode_steps"):
    policy.check(config, max_model_len=64)
