"""The `Executor` contract: every executor implements it, and the engine keeps its side.

Under async scheduling the engine launches step N+1 before it collects step N, so
the last request can finish (a stop token in step N) while step N+1 is in flight.
`run_until_done` and `generate` must not return before that step is collected:
every ticket the engine submits is collected, once.
"""

import inspect

import pytest
from engine_utils import FakeExecutor, fake_engine

from configs import hardware as hardware_lib
from configs import tiny
from kvpage import build
from kvpage.device.executor import JaxExecutor
from kvpage.interface import Executor
from kvpage.request import SamplingParams
from kvpage.sim.executor import SimExecutor

STOP = 3
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]


@pytest.mark.parametrize("executor", [JaxExecutor, SimExecutor, FakeExecutor])
def test_every_executor_implements_the_whole_contract(executor):
  assert issubclass(executor, Executor) and not inspect.isabstract(executor)


def stop_after(num_tokens: int):
  """A fake model that, after a 10-token prompt, samples `100 + position` and `STOP` as
  its `num_tokens`-th token."""
  def sample(request_id: str, position: int) -> int:
    del request_id  # Unused: every request's sequence has the same shape.
    return STOP if position == 9 + num_tokens - 1 else 100 + position
  return sample


def assert_drained(engine) -> None:
  executor = engine.executor
  assert not engine.has_unfinished() and engine._in_flight is None
  assert executor.in_flight == 0
  assert executor.num_submitted == executor.num_collected > 0
  pool = engine.scheduler.page_pool
  assert pool.num_free_pages == pool.num_usable_pages


@pytest.mark.parametrize("num_decode_steps", [1, 4], ids=["1-step", "4-step"])
@pytest.mark.parametrize("ending", ["stop", "length"])
@pytest.mark.parametrize("entry", ["run_until_done", "generate"])
def test_async_loop_returns_only_after_collecting_every_step(entry, ending, num_decode_steps):
  # Each prompt is padded to 10 tokens so the stop position is the same for all.
  prompts = [prompt + [0] * (10 - len(prompt)) for prompt in PROMPTS]
  engine = fake_engine(sample=stop_after(5), num_decode_steps=num_decode_steps)
  stops = (STOP,) if ending == "stop" else ()
  sampling = SamplingParams(max_tokens=7, stop_token_ids=stops)
  if entry == "generate":
    requests = engine.generate(prompts, sampling)
  else:
    requests = [engine.add_request(p, sampling)[0] for p in prompts]
    engine.run_until_done()
  assert_drained(engine)
  tokens = [109, 110, 111, 112, STOP, 114, 115]
  if ending == "stop":
    assert all(r.finish_reason == "stop" and r.output_ids == tokens[:5] for r in requests)
  else:
    assert all(r.finish_reason == "length" and r.output_ids == tokens for r in requests)
  if num_decode_steps > 1:
    assert engine.executor.num_multi_step_launches > 0


def test_sync_loop_collects_every_step_too():
  engine = fake_engine(sample=stop_after(2), async_scheduling=False)
  engine.generate([[1] * 10, [2] * 10], SamplingParams(max_tokens=4, stop_token_ids=(STOP,)))
  assert_drained(engine)


def test_simulated_executor_keeps_the_contract():
  config = tiny.get_config()
  engine = build.sim_engine(config.model, hardware_lib.get_hardware("cpu"), config.scheduler,
                            num_pages=64, page_size=16)
  executor = engine.executor
  assert executor.warmup(8, 64) == 0 and executor.num_compiles == 0
  assert engine.clock() == 0.0 and executor.costs == []  # warm-up ran nothing
  requests = engine.generate(PROMPTS, SamplingParams(max_tokens=5, ignore_eos=True))
  assert [len(r.output_ids) for r in requests] == [5, 5, 5] and engine.clock() > 0


def test_steps_are_priced_before_the_first_request_without_running_any():
  """`Engine.price_steps`: the wait forecast has prices (retry hints, ETAs) from the
  executor's warm-up measurements, and the simulated device's timeline is untouched."""
  config = tiny.get_config()
  engine = build.sim_engine(config.model, hardware_lib.get_hardware("cpu"), config.scheduler,
                            num_pages=64, page_size=16)
  wait = engine.scheduler.admission.wait
  assert not wait.priced()
  assert engine.price_steps() > 0
  assert wait.priced() and engine.clock() == 0.0 and engine.executor.costs == []
  decode, prefill = (wait.costs.predict(n, 0, prefill=p) for n, p in ((4, False), (64, True)))
  assert decode is not None and prefill is not None and 0 < decode < prefill


def test_the_simulated_device_queues_steps_behind_the_one_in_flight():
  """`submit` returns at once with the step queued behind the one in flight; `collect`
  waits (advances the clock) to its end. So under async scheduling a request that
  arrives while step k runs is seen when step k's samples return, after step k + 1 was
  launched: it joins step k + 2, as on a real device."""
  config = tiny.get_config()
  engine = build.sim_engine(config.model, hardware_lib.get_hardware("cpu"), config.scheduler,
                            num_pages=64, page_size=16)
  assert engine.async_scheduling  # the config's default, as for a real engine
  executor, clock = engine.executor, engine.clock
  sampling = SamplingParams(max_tokens=6, ignore_eos=True)
  first, _ = engine.add_request([1] * 40, sampling)
  engine.step()  # launches step 1 (the prompt); nothing to collect yet
  assert clock() == 0.0 and len(executor.costs) == 1
  engine.step()  # launches step 2 (first's decode) behind it, then waits for step 1
  assert clock() == pytest.approx(executor.costs[0].seconds)
  late, _ = engine.add_request([2] * 40, sampling)  # arrived while step 1 ran
  assert engine.step()[0].new_token_ids  # launches step 3, collects step 2
  tokens = [cost.work.num_tokens for cost in executor.costs]
  assert tokens == [40, 1, 41]  # late's prompt went into step 3, not step 2
  assert clock() == pytest.approx(executor.costs[0].seconds + executor.costs[1].seconds)
  engine.run_until_done()
  assert len(first.output_ids) == len(late.output_ids) == 6
  assert clock() == pytest.approx(sum(cost.seconds for cost in executor.costs))
  first_token = next(event.time for event in late.events if event.kind == "first_token")
  assert first_token == pytest.approx(sum(cost.seconds for cost in executor.costs[:3]))
