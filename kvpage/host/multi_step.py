"""Multi-step decoding: one launch of several decode iterations (vLLM's multi-step
scheduling), decided after the scheduler has built an ordinary step.

Pure Python: never imports jax.
"""

from kvpage.host.pages import PagePool
from kvpage.interface import SchedulerOutput


def extend_decodes(out: SchedulerOutput, pool: PagePool, *, num_decode_steps: int,
                   max_model_len: int, nothing_else_waits: bool) -> None:
  """Turns an all-decode step into up to `num_decode_steps` iterations, in place.

  Only when nothing else could use the launch: every scheduled sequence is a decode,
  `nothing_else_waits` (the token budget left room, so no running request was left
  out, and no request waits or sits swapped: a joining prefill would wait the whole
  launch), and the step preempted and copied nothing. Each sequence runs as many
  iterations as it still may generate (at most `num_decode_steps`), and its pages for
  all of them are reserved now; if they do not all fit in the free pages, the step
  stays a single iteration rather than preempt anyone for lookahead. A request that
  asks for log-probabilities keeps the step single (they come back one step at a time),
  and so does one below its `min_tokens` (its stop tokens are held back per step).
  """
  if (num_decode_steps == 1 or not out.scheduled or not nothing_else_waits
      or out.preempted or out.swap_in or out.swap_out
      or any(seq.is_prefill or not seq.samples or seq.request.sampling.logprobs is not None
             or seq.sample_index < seq.request.sampling.min_tokens
             for seq in out.scheduled)):
    return
  plans = []
  for seq in out.scheduled:
    request = seq.request
    num_steps = min(num_decode_steps, request.sampling.max_tokens - request.num_sampled,
                    max_model_len - seq.start_position)
    plans.append((seq, num_steps, pool.num_missing_pages(request.request_id,
                                                       seq.start_position + num_steps)))
  if sum(missing for _, _, missing in plans) > pool.num_free_pages:
    return
  for seq, num_steps, missing in plans:
    if missing:
      pool.grow_to(seq.request_id, seq.start_position + num_steps)
      seq.page_ids = list(seq.request.page_ids)
    seq.num_steps = num_steps
  out.num_steps = num_decode_steps
