"""How a fleet's replica builds its engine, in its own process (`kvpage.serve.ray_fleet`).

`ReplicaRecipe` is what `python -m experiments.serve --replicas=N` sends to each Ray
Serve replica: the finished config (every flag and override applied, the lines held,
checked), the executor, the checkpoint and the warm-up to do. Calling it in the replica
builds the engine as the single server does (`cli.serving_engine`), compiles its step
programs and prices its step shapes, so hints are honest from the first request. A
module of its own, free of absl flags: the replica process imports it by name.
"""

import dataclasses
import os
from typing import Any

from experiments import cli


@dataclasses.dataclass(frozen=True)
class ReplicaRecipe:
  """Everything a replica needs to build its engine; paths absolute (a replica's
  working directory is Ray's, not the command's)."""

  config: Any  # ml_collections.ConfigDict, final
  executor: str  # "jax" or "sim"
  model_name: str
  checkpoint: str | None = None
  warmup: bool = True
  warmup_sampling: bool = True
  warmup_logprobs: bool = False
  compilation_cache: str = ""

  def __post_init__(self) -> None:
    for path in (self.checkpoint, self.compilation_cache):
      if path and not os.path.isabs(path):
        raise ValueError(f"a replica recipe needs absolute paths, got {path!r}")

  def __call__(self) -> Any:
    from configs import hardware as hardware_lib
    from kvpage.serve.ray_fleet import ReplicaParts
    from models import hf

    cli.enable_compilation_cache(self.compilation_cache)
    setup = cli.serving_engine(self.config, executor=self.executor,
                               hardware=hardware_lib.get_hardware(self.config.hardware),
                               checkpoint=self.checkpoint, paced=True)
    engine, scheduler = setup.engine, setup.config.scheduler
    tokenizer = hf.load_tokenizer(self.checkpoint) if self.checkpoint else None
    if tokenizer is not None and len(tokenizer) > setup.config.model.vocab_size:
      raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the model's "
                       f"vocabulary is {setup.config.model.vocab_size}")
    if self.warmup:
      engine.executor.warmup(scheduler.max_num_seqs, scheduler.max_num_batched_tokens,
                             all_greedy=(True, False) if self.warmup_sampling else (True,),
                             num_decode_steps=scheduler.num_decode_steps,
                             logprobs=self.warmup_logprobs)
      engine.price_steps()
    return ReplicaParts(engine, tokenizer, self.model_name)
