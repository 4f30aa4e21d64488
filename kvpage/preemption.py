"""Preemption: who gives way when a running request needs a page and none is free.

The victim is the least important running request: the largest priority value
(lower = more important, as in vLLM), the newest among equals — the newest has
the least sunk work and the most remaining wait tolerance (vLLM's FCFS recompute
order, SOSP'23 section 4.5). Three modes, per `config.preemption_mode`:

  * **recompute**: free its pages; it re-enters the *front* of the waiting queue and
    later prefills prompt + generated tokens again in one pass. Cheap when prompts
    are short: recomputing is a compute-bound prefill, faster than re-decoding.
  * **swap**: copy its pages to the host pool and resume it, before any waiting
    request, once device pages free up; the step output lists the page copies. When
    the host pool cannot take it, it falls back to recompute.
  * **abort**: finish it with reason `"preempted"` — for deployments that prefer a
    fast error over a slow answer.

Pure Python: never imports jax.
"""

from typing import TYPE_CHECKING

from kvpage.request import Request, RequestStatus
from kvpage.scheduler_output import Preemption, SchedulerOutput

if TYPE_CHECKING:
  from kvpage.scheduler import Scheduler

PREEMPTION_MODES = ("recompute", "swap", "abort")


def importance(request: Request) -> tuple[int, float, int]:
  """Sort key: larger = less important = preempted first, resumed last."""
  return request.priority, request.arrival_time, request.admission_index


def preempt(scheduler: "Scheduler", victim: Request, out: SchedulerOutput,
            now: float) -> str:
  """Moves `victim` (already out of the running set) to its next queue; returns the mode.

  For mode "abort" the caller finishes the request.
  """
  mode = scheduler.config.preemption_mode
  bm = scheduler.block_manager
  rid = victim.request_id
  victim.num_preemptions += 1
  if mode == "swap" and not bm.can_swap_out(rid):
    victim.log(now, "swap_fallback", num_pages=len(victim.page_ids),
               num_free_host_pages=bm.num_free_host_pages)
    mode = "recompute"
  victim.log(now, "preempted", mode=mode, num_computed_tokens=victim.num_computed_tokens)
  out.preempted.append(Preemption(victim, mode))
  if mode == "swap":
    out.swap_out.extend(bm.swap_out(rid))
    victim.page_ids, victim.host_page_ids = [], bm.host_table(rid)
    victim.status = RequestStatus.SWAPPED
    victim.log(now, "swapped_out", num_pages=len(victim.host_page_ids))
    scheduler.swapped.append(victim)
    scheduler.admission.add_backlog(victim)
  elif mode == "recompute":
    bm.free(rid)
    victim.page_ids = []
    victim.num_computed_tokens = 0  # prompt + generated tokens are prefilled again
    victim.status = RequestStatus.WAITING
    scheduler.waiting.appendleft(victim)
    scheduler.admission.add_backlog(victim)
  return mode
