"""PNG of the planners' straggler factor per micro-step (benchmark output).

Reads the per-micro-step series that ``evaluate.run_benchmark`` returns and
draws, per configuration, max/mean device load (averaged over layers) for
every method. matplotlib is imported here only, with the Agg backend, so
nothing else in the planner needs it.
"""
from __future__ import annotations

import os


def plot_max_over_mean(series_by_config: dict, path: str) -> str:
  """Writes one panel per configuration; returns the PNG path.

  Args:
    series_by_config: {config name: {method: max/mean per micro-step}}.
    path: a .png file, or a directory to write planner_max_over_mean.png in.
  """
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  from matplotlib import ticker  # pylint: disable=import-outside-toplevel

  if os.path.isdir(path) or not path.endswith('.png'):
    os.makedirs(path, exist_ok=True)
    path = os.path.join(path, 'planner_max_over_mean.png')
  names = list(series_by_config)
  fig, axes = plt.subplots(len(names), 1, figsize=(9, 3.0 * len(names)),
                           squeeze=False, sharex=False)
  for ax, name in zip(axes[:, 0], names):
    for method, series in series_by_config[name].items():
      ax.plot(range(len(series)), series, label=method, lw=1.2)
    ax.set_title(name, fontsize=9)
    ax.set_ylabel('max/mean load')
    ax.axhline(1.0, color='grey', lw=0.5)
    # Log scale: static sits at 2-4x while ForeMoE's 1-5% must stay visible.
    ax.set_yscale('log')
    top = max(float(max(s)) for s in series_by_config[name].values())
    ax.yaxis.set_major_locator(ticker.FixedLocator(
        [t for t in (1.0, 1.05, 1.1, 1.25, 1.5, 2, 3, 4, 6, 8)
         if t <= top * 1.05]))
    ax.yaxis.set_major_formatter(ticker.FormatStrFormatter('%.2f'))
    ax.yaxis.set_minor_locator(ticker.NullLocator())
    ax.grid(alpha=0.3)
  axes[-1, 0].set_xlabel('scored micro-step (layers averaged)')
  axes[0, 0].legend(fontsize=8, ncol=4, loc='upper right')
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
