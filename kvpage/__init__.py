"""kvpage: hold the KV-cache memory line first, push back in tokens and pages.

The host world `kvpage.host` (the page pool, admission, the scheduler, the engine
loop) is pure Python and never imports jax; the device world `kvpage.device` (the paged
cache, the backends that compute a model's ops, sampling, the jitted step,
`JaxExecutor`) is jax; `kvpage.sim` (a simulated GPU, its step-cost model and
calibration, workloads, replay, the capacity model) stands in for the device and is
host-only. They meet in `kvpage.interface` (the plain data of one step and the
`Executor` contract), `kvpage.request` and `kvpage.batch` (the one bridge to arrays).
What real and simulated runs share sits beside them, each module named for what it
is: `model_shape`, `memory_plan`, `metrics`, `clock`, `premises`. `kvpage.build` and
`kvpage.sizing` make a sized engine from a config. See docs/architecture.md;
tests/test_layering.py enforces the dependency rule.
"""

__version__ = "0.1.0"
