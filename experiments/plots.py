"""The standard figures: one run's timeline, and a sweep's metric-vs-load curves.

  timeline(summary, steps, requests)   KV usage (with the admission watermark), running /
                                       waiting / swapped requests, rejections and
                                       preemptions over time; TTFT and TPOT CDFs
  sweep_curves(rows, x=..., metrics=.) one panel per metric against `x` (the load), one
                                       line per policy, mean over seeds with min-max bars
  threshold(axes, value, label)        an SLO, capacity or rate drawn as a labelled line
  legend_outside(axes)                 the legend beside the panel, off the data

Every figure carries its premises (model, dtype, hardware, executor, policies,
workload, seeds, versions) in its title lines. matplotlib comes with the `notebooks`
extra; the backend is Agg (headless), chosen before pyplot loads, unless a notebook
already picked its own.
"""

import collections
import json
import math
import pathlib
import sys
from collections.abc import Mapping, Sequence
from typing import Any

try:
  import matplotlib
except ImportError:  # bad setup, not a defect: one `error:` line from the entry points
  raise ValueError("figures need matplotlib: pip install -e '.[notebooks]'") from None

if "matplotlib.pyplot" not in sys.modules and "ipykernel" not in sys.modules:
  matplotlib.use("Agg")
from matplotlib import figure as figure_lib  # (after the backend is chosen)
from matplotlib import pyplot as plt

from kvpage import metrics

Row = Mapping[str, Any]


def read_jsonl(path: str | pathlib.Path) -> list[dict[str, Any]]:
  return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line]


def save(fig: figure_lib.Figure, path: str | pathlib.Path) -> pathlib.Path:
  """Writes `fig` as a PNG and closes it."""
  path = pathlib.Path(path)
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)
  return path


def premises_line(premises: Row, swept: Sequence[str] = ()) -> str:
  """One run's premises in two short lines, for a title; a `swept` key (a config path
  such as `scheduler.chunk_size`, or a serve_bench setting) reads "swept"."""
  names = {key.split(".")[-1] for key in swept}
  policy = {key: ("swept" if key in names else value)
            for key, value in premises.get("policies", {}).items()}
  work = {key: ("swept" if key in names else value)
          for key, value in premises.get("workload", {}).items()}
  packages = premises.get("packages", {})
  return (f"{premises.get('model', {}).get('name')} {premises.get('dtype')} on "
          f"{premises.get('hardware', {}).get('name')} ({premises.get('executor')}); "
          f"prefill={policy.get('prefill_policy')} chunk={policy.get('chunk_size')} "
          f"budget={policy.get('max_num_batched_tokens')} watermark={policy.get('watermark')} "
          f"estimate={policy.get('output_estimate')}\n"
          f"{work.get('observed', {}).get('num_requests')} requests at {work.get('arrival_rate')}"
          f"/s ({work.get('arrival_process')}), prompt {work.get('prompt_len')}, output "
          f"{work.get('output_len')}; seed {'swept' if 'seed' in names else premises.get('seed')}; "
          f"jax {packages.get('jax')}, python {premises.get('python')}")


def threshold(axes, value: float | None, label: str, *, vertical: bool = False,
              color: str = "k") -> None:
  """A premise drawn on a figure: a dashed line at `value` (an SLO, a capacity, a
  sustainable rate) with its label; nothing when `value` is None."""
  if value is None:
    return
  if vertical:
    axes.axvline(value, color=color, ls="--", lw=1)
    axes.annotate(f" {label}", (value, 1.0), xycoords=("data", "axes fraction"),
                  fontsize=7, va="top", ha="left", rotation=90, color=color)
  else:
    axes.axhline(value, color=color, ls="--", lw=1)
    axes.annotate(f"{label} ", (1.0, value), xycoords=("axes fraction", "data"),
                  fontsize=7, va="bottom", ha="right", color=color)


def legend_outside(axes, **kwargs: Any) -> None:
  """The legend to the right of `axes`, off the data."""
  axes.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=7, **kwargs)


def _cdf(axes, values: Sequence[float], label: str) -> None:
  values = sorted(v for v in values if v is not None)
  if not values:
    axes.text(0.5, 0.5, f"no {label}", ha="center", transform=axes.transAxes)
    return
  fractions = [(i + 1) / len(values) for i in range(len(values))]
  axes.step([1e3 * v for v in values], fractions, where="post")
  marks = metrics.percentiles(values)  # the summary's own p50 and p99
  for value, name in ((marks["p50"], "p50"), (marks["p99"], "p99")):
    axes.axvline(1e3 * value, color="grey", lw=0.8, ls=":")
    axes.annotate(f"{name} {1e3 * value:.0f} ms", (1e3 * value, 0.05), rotation=90,
                  fontsize=7, va="bottom")
  axes.set(xlabel=f"{label} (ms)", ylabel="fraction of requests", ylim=(0, 1.02))


def timeline(summary: Row, steps: Sequence[Row], requests: Sequence[Row]) -> figure_lib.Figure:
  """One run: the KV line and the queue over time, push-back, and latency CDFs."""
  premises = summary["premises"]
  time = [step["time"] for step in steps]
  fig, axes = plt.subplots(3, 2, figsize=(12, 10), constrained_layout=True)
  fig.suptitle("kvpage serve_bench timeline\n" + premises_line(premises), fontsize=9)

  kv = axes[0, 0]
  kv.plot(time, [100 * step["kv_usage"] for step in steps], lw=1, label="KV usage")
  watermark = premises.get("policies", {}).get("watermark")
  if watermark is not None:
    kv.axhline(100 * (1 - watermark), color="red", ls="--", lw=1,
               label=f"admission line (watermark {watermark:.0%} free)")
  kv.set(ylabel="KV pages used (%)", ylim=(0, 102), title="the KV-cache memory line")
  kv.legend(fontsize=7, loc="lower right")

  queue = axes[0, 1]
  for key, label in (("num_running", "running"), ("num_waiting", "waiting"),
                     ("num_swapped", "swapped")):
    queue.plot(time, [step[key] for step in steps], lw=1, label=label)
  queue.set(ylabel="requests", title="running / waiting / swapped")
  queue.legend(fontsize=7)

  pushed = axes[1, 0]
  for key, prefix in (("rejections", "rejected "), ("preemptions", "preempted: ")):
    totals: dict[str, int] = collections.Counter()
    series: dict[str, list[int]] = collections.defaultdict(list)
    names = sorted({name for step in steps for name in step[key]})
    for step in steps:
      for name in names:
        totals[name] += step[key].get(name, 0)
        series[name].append(totals[name])
    for name in names:
      pushed.step(time, series[name], where="post", label=f"{prefix}{name}")
  pushed.set(ylabel="cumulative count", title="push-back: rejections and preemptions")
  if pushed.get_legend_handles_labels()[0]:
    pushed.legend(fontsize=7)
  else:
    pushed.text(0.5, 0.5, "none", ha="center", transform=pushed.transAxes)

  tokens = axes[1, 1]
  tokens.plot(time, [step["prompt_tokens"] for step in steps], lw=0.8, label="prompt tokens")
  tokens.plot(time, [step["generated_tokens"] for step in steps], lw=0.8,
              label="generated tokens")
  tokens.set(ylabel="tokens per step", title="the token budget's use")
  tokens.legend(fontsize=7)
  for axes_ in (kv, queue, pushed, tokens):
    axes_.set_xlabel("time (s)")

  done = [row for row in requests if row["finish_reason"] in ("length", "stop")]
  _cdf(axes[2, 0], [row["ttft_s"] for row in done], "TTFT")
  axes[2, 0].set_title(f"time to first token ({len(done)} finished requests)")
  _cdf(axes[2, 1], [row["tpot_s"] for row in done], "TPOT")
  axes[2, 1].set_title("time per output token")
  return fig


def _label(row: Row, keys: Sequence[str]) -> str:
  return ", ".join(f"{key.split('.')[-1]}={row['cell'][key]}" for key in keys) or "all"


def _is_duration(metric: str) -> bool:
  return metric.endswith("_s") and not metric.endswith("_per_s")


def sweep_curves(rows: Sequence[Row], *, x: str, metrics: Sequence[str],
                 title: str = "", log_x: bool = False, lines: Sequence[str] | None = None,
                 swept: Sequence[str] | None = None) -> figure_lib.Figure:
  """Each metric against `x`, one line per combination of the other swept keys (`lines`,
  by default every swept key but `x` and the seed), mean over seeds with min-max bars.

  `rows` are a sweep's tidy rows: `row["cell"]` holds the swept values (and `seed`),
  `row["metrics"]` the figures. `swept` names the premises the title marks as swept
  (default: the cell's keys). Durations (`*_s`) are drawn in milliseconds.
  """
  if not rows:
    raise ValueError("no sweep rows to plot")
  others = [key for key in rows[0]["cell"] if key not in (x, "seed")]
  lines = others if lines is None else list(lines)
  groups: dict[str, dict[Any, list[Row]]] = collections.defaultdict(
      lambda: collections.defaultdict(list))
  for row in rows:
    groups[_label(row, lines)][row["cell"][x]].append(row)
  columns = min(3, len(metrics))
  rows_of_panels = math.ceil(len(metrics) / columns)
  fig, axes = plt.subplots(rows_of_panels, columns, figsize=(4.5 * columns, 3.4 * rows_of_panels),
                           squeeze=False, constrained_layout=True)
  seeds = sorted({row["cell"].get("seed") for row in rows})
  swept = list(rows[0]["cell"]) if swept is None else list(swept)
  fig.suptitle(f"{title}\n{premises_line(rows[0]['premises'], swept)}\n"
               f"mean over seeds {seeds}, "
               "bars: min-max", fontsize=8)
  for index, metric in enumerate(metrics):
    axes_ = axes[index // columns, index % columns]
    for label, by_x in groups.items():
      xs = sorted(by_x, key=float)
      values = [[row["metrics"].get(metric) for row in by_x[value]] for value in xs]
      present = [(float(value), [v for v in vs if v is not None and math.isfinite(v)])
                 for value, vs in zip(xs, values, strict=True)]
      present = [(value, vs) for value, vs in present if vs]
      if not present:
        continue
      scale = 1e3 if _is_duration(metric) else 1.0  # seconds shown as milliseconds
      present = [(value, [scale * v for v in vs]) for value, vs in present]
      means = [sum(vs) / len(vs) for _, vs in present]
      low = [mean - min(vs) for mean, (_, vs) in zip(means, present, strict=True)]
      high = [max(vs) - mean for mean, (_, vs) in zip(means, present, strict=True)]
      axes_.errorbar([value for value, _ in present], means, yerr=[low, high], marker="o",
                     ms=3, capsize=2, lw=1, label=label)
    axes_.set(xlabel=x, title=(metric.removesuffix("_s") + " (ms)") if _is_duration(metric)
              else metric)
    if log_x:
      axes_.set_xscale("log")
    axes_.grid(alpha=0.3)
  axes[0, 0].legend(fontsize=6)
  for index in range(len(metrics), rows_of_panels * columns):
    axes[index // columns, index % columns].set_visible(False)
  return fig
