"""The `Executor` contract: every executor implements it, and the engine keeps its side."""

import inspect

import pytest
from engine_utils import FakeExecutor

from configs import hardware as hardware_lib
from configs import tiny
from experiments import build
from kvpage.device.executor import JaxExecutor
from kvpage.host.request import SamplingParams
from kvpage.interface import Executor
from kvpage.sim.executor import SimExecutor

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]


@pytest.mark.parametrize("executor", [JaxExecutor, SimExecutor, FakeExecutor])
def test_every_executor_implements_the_whole_contract(executor):
  assert issubclass(executor, Executor) and not inspect.isabstract(executor)


def test_simulated_executor_keeps_the_contract():
  config = tiny.get_config()
  engine = build.sim_engine(config.model, hardware_lib.get_hardware("cpu"), config.scheduler,
                            num_pages=64, page_size=16)
  executor = engine.executor
  assert executor.warmup(8, 64) == 0 and executor.num_compiles == 0
  assert engine.clock() == 0.0 and executor.costs == []  # warm-up ran nothing
  requests = engine.generate(PROMPTS, SamplingParams(max_tokens=5, ignore_eos=True))
  assert [len(r.output_ids) for r in requests] == [5, 5, 5] and engine.clock() > 0
