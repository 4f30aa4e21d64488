"""Wiring: a model, its params and a scheduler config into an `Engine`.

kvpage is model-agnostic and models import kvpage, so the two meet here, in the
experiments layer: `llama_engine` closes the model's forward over its config, puts
it behind a `JaxExecutor` with a paged cache, and pairs it with a `Scheduler`.
"""

import functools
from collections.abc import Callable
from typing import Any

import ml_collections

from kvpage import paged_cache
from kvpage.clock import WallClock
from kvpage.engine import Engine
from kvpage.executor import JaxExecutor
from kvpage.scheduler import Scheduler
from models import llama


def llama_engine(model_config: ml_collections.ConfigDict, params: Any,
                 scheduler_config: ml_collections.ConfigDict, *, num_pages: int,
                 page_size: int, num_host_pages: int = 0,
                 clock: Callable[[], float] | None = None,
                 on_step: Callable[..., None] | None = None) -> Engine:
  """An engine serving a Llama model through a paged cache of `num_pages` pages."""
  model_config = ml_collections.FrozenConfigDict(model_config)
  cache = paged_cache.init(model_config, num_pages=num_pages, page_size=page_size)
  forward = functools.partial(llama.forward, config=model_config)
  executor = JaxExecutor(forward, params, cache, num_host_pages=num_host_pages)
  scheduler = Scheduler(scheduler_config, num_pages=num_pages, page_size=page_size,
                        max_model_len=model_config.max_seq_len,
                        num_host_pages=num_host_pages, clock=clock or WallClock())
  return Engine(scheduler, executor, on_step=on_step)
