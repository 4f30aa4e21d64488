"""absl entry points: each a `main(argv)` driven by flags and an ml_collections config."""

import sys

if sys.argv[:1] == ["-m"]:  # `python -m experiments.NAME` is starting (`runpy` sets "-m")
  from experiments import cli  # interrupts caught from the first import on: jax's take seconds

  cli.catch_interrupts()
