"""kvpage: hold the KV-cache memory line first, push back in tokens and pages.

The host world `kvpage.host` (requests, the page pool, admission, the scheduler, the
engine loop) is pure Python and never imports jax; the device world `kvpage.device`
(the paged cache, attention, sampling, the jitted step, `JaxExecutor`) is jax;
`kvpage.sim` (a simulated GPU, clocks, workloads, metrics, capacity) stands in for the
device and is host-only. They meet in `kvpage.interface` (the plain data of one step
and the `Executor` contract) and `kvpage.batch` (the one bridge to arrays).
See docs/architecture.md; tests/test_layering.py enforces the dependency rule.
"""

__version__ = "0.1.0"
