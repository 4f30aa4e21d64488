"""The simulator, host-only: a simulated GPU, its step-cost model and calibration, workloads,
replay and the capacity model.

Like `kvpage.host`, it never imports jax, flax or `kvpage.device`, so the 13B setup
runs on a laptop: `SimExecutor` stands in for `JaxExecutor` behind the same contract.
"""
