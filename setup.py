"""kvpage: serve Transformer LLMs under rising concurrency by holding the KV-cache line."""

import setuptools

SERVE = [
    "fastapi>=0.110",
    "uvicorn>=0.30",
    "httptools>=0.6",  # uvicorn's fast HTTP parser
    "prometheus_client>=0.20",
    "transformers>=4.45",
    "tokenizers>=0.19",
    "jinja2>=3.1",  # chat templates
]
# The figures (experiments/plots.py) and the notebooks; nbclient + ipykernel run them
# headless (the tests do), Jupyter opens them.
NOTEBOOKS = [
    "matplotlib>=3.8",
    "nbformat>=5.9",
    "nbclient>=0.10",
    "ipykernel>=6.29",
]

setuptools.setup(
    name="kvpage",
    version="0.1.0",
    description=(
        "A JAX research framework for LLM serving under load: paged KV cache, "
        "token-level admission control, continuous batching."
    ),
    python_requires=">=3.10",
    # The JAX range CI proves (.ci/run): jax 0.10.2 on Python 3.11, 0.11.2 (the kernel
    # tests) and 0.12.0.1 on Python 3.12, each with flax 0.12.
    packages=setuptools.find_packages(include=["kvpage*", "models*", "configs*", "experiments*"]),
    # The CPU kernels' sources, compiled on first use (kvpage.device.cpu).
    package_data={"kvpage.device.cpu": ["*.cc", "*.h"]},
    install_requires=[
        "jax>=0.10.2,<0.13",
        "jaxlib>=0.10.2,<0.13",
        "flax>=0.12.8,<0.13",
        "optax>=0.2",
        "numpy>=1.26",
        "scipy>=1.11",  # the simulator's calibration fit (kvpage.sim.calibration)
        "absl-py>=2.0",
        "ml-collections>=1.0",
        "safetensors>=0.4",
        "rich>=13",  # progress bars
    ],
    extras_require={
        # The streaming gateway (`python -m experiments.serve`); transformers for its
        # tokenizer and chat templates only (it loads no torch).
        "serve": SERVE,
        "notebooks": [*NOTEBOOKS, "jupyterlab>=4"],
        "test": [
            *SERVE,
            *NOTEBOOKS,
            "openai>=1.40",  # the official client, driven against the server in tests
            "httpx>=0.27",
            "aiohttp>=3.9",  # benchmarks/serve_http.py's load client, tested here
            "pytest>=8",
            "pytest-xdist>=3.5",  # `pytest -n 2`: two workers, the suite in ~3/4 of the time
            "hypothesis>=6.100",
            "chex>=0.1.90",
            "ruff>=0.6",
            "mypy>=1.11",
            # Test-time references only (parity checks), never imported by kvpage:
            # torch 2.13.0's CPU build is the one these machines carry, for Python 3.11
            # only; on newer Pythons the torch parity tests skip.
            "torch==2.13.0; python_version < '3.12'",
        ],
    },
)
