"""The research harness, host-only: capacity model, simulated GPU, clocks, workloads, metrics.

Like `kvpage.host`, it never imports jax, flax or `kvpage.device`, so the 13B setup
runs on a laptop: `SimExecutor` stands in for `JaxExecutor` behind the same contract.
"""
