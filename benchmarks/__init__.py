import sys

if sys.argv[:1] == ["-m"]:  # `python -m benchmarks.NAME` is starting (`runpy` sets "-m")
  from experiments import cli  # interrupts caught from the first import on: jax's take seconds

  cli.catch_interrupts()
