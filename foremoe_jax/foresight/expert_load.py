"""Per-expert load of every RL step, from the foresight: logged and drawn.

The foresight (`loads.py`) already counts, before the update runs, how many
of the update's tokens every (micro-step, data group, layer, device) sends
to every expert. Summed over micro-steps, groups and devices that is the
step's token count per (MoE layer, expert), `tokens_LE`: the number users of
MoE RL frameworks watch for routing collapse (a layer whose tokens pile onto
a few experts) and hot experts, and the number that explains an update that
slows down over a run (the busiest expert's device sets the pace).

What goes where, per RL step:
- metrics.jsonl gets the compact form (`summary`): the hottest expert's
  share of its layer's tokens and its id, per MoE layer; the largest share
  over layers; the share of (layer, expert) pairs that got no token. These
  are O(L) numbers, readable in the step line's neighbourhood.
- expert_load.jsonl (`EXPERT_LOAD_FILE`) gets the whole [L, E] count
  matrix, one line per step; at Qwen3-30B-A3B's 48 x 128 that is ~30 kB a
  step, which is why it is not in metrics.jsonl.
- TensorBoard (utils/tensorboard.py) gets, from the same record, a histogram
  of the per-expert counts of every MoE layer and an image of the layer x
  expert heatmap (`heatmap_rgb`).
- At the end of the run, `plot` draws expert_load.png from expert_load.jsonl.

Host-side numpy; matplotlib only in `heatmap_rgb` (its colormap) and `plot`.
"""
from __future__ import annotations

import os

import numpy as np

EXPERT_LOAD_FILE = 'expert_load.jsonl'
# Record key of the full count matrix (expert_load.jsonl and TensorBoard).
TOKENS_KEY = 'expert_tokens_LE'
# The heatmap's colour scale: log2 of load over the layer's mean, clipped to
# +-this (a factor of 8 either way); uniform routing is the middle colour.
_LOG2_RANGE = 3.0


def expert_tokens(loads_MGLDE) -> np.ndarray:
  """Tokens per (MoE layer, expert) of the step, int64 [L, E].

  Each token counts once at each of its top-k experts, so a layer's row sums
  to (routed tokens) x top_k.
  """
  loads_MGLDE = np.asarray(loads_MGLDE)
  if loads_MGLDE.ndim != 5:
    raise ValueError(f'loads must be [M, G, L, D, E], got shape '
                     f'{loads_MGLDE.shape}.')
  return loads_MGLDE.sum(axis=(0, 1, 3)).astype(np.int64)


def summary(tokens_LE) -> dict:
  """The compact per-step form that goes to metrics.jsonl.

  expert_hot_share: per MoE layer, the hottest expert's share of the layer's
    tokens (1/E when routing is uniform, 1 when it has collapsed onto one).
  expert_hot_id: per MoE layer, that expert's id (lowest id on ties).
  expert_hot_share_max: the largest share over layers.
  expert_unused_frac: share of (layer, expert) pairs that got no token.
  """
  tokens_LE = np.asarray(tokens_LE, np.float64)
  total_L = tokens_LE.sum(axis=1)
  share_L = tokens_LE.max(axis=1) / np.maximum(total_L, 1.0)
  return dict(
      expert_hot_share=[round(float(s), 5) for s in share_L],
      expert_hot_id=[int(i) for i in tokens_LE.argmax(axis=1)],
      expert_hot_share_max=float(share_L.max()) if share_L.size else 0.0,
      expert_unused_frac=float(np.mean(tokens_LE == 0)))


def relative_load(tokens_LE) -> np.ndarray:
  """Load over the layer's mean per expert, float64 [L, E] (1 = uniform;
  a layer with no tokens reads 1 everywhere)."""
  tokens_LE = np.asarray(tokens_LE, np.float64)
  mean_L1 = tokens_LE.mean(axis=1, keepdims=True)
  return np.where(mean_L1 > 0, tokens_LE / np.maximum(mean_L1, 1e-300), 1.0)


def heatmap_rgb(tokens_LE, cell_px: int | None = None) -> np.ndarray:
  """The layer x expert heatmap as a uint8 RGB image [H, W, 3].

  Rows are MoE layers, columns experts; the colour is log2(load / layer
  mean) on a diverging scale: white = uniform, red = hot, blue = cold (clipped
  at 8x either way). Every cell is `cell_px` pixels square (default: enough
  to make the image about 256 pixels on its longer side).
  """
  from matplotlib import colormaps  # pylint: disable=g-import-not-at-top
  rel_LE = relative_load(tokens_LE)
  num_layers, num_experts = rel_LE.shape
  if cell_px is None:
    cell_px = max(1, 256 // max(num_layers, num_experts, 1))
  with np.errstate(divide='ignore'):
    log_LE = np.log2(np.maximum(rel_LE, 2.0 ** -_LOG2_RANGE))
  unit_LE = (np.clip(log_LE, -_LOG2_RANGE, _LOG2_RANGE) + _LOG2_RANGE) / (
      2 * _LOG2_RANGE)
  rgb_LE3 = (colormaps['RdBu_r'](unit_LE)[..., :3] * 255).round()
  rgb_LE3 = rgb_LE3.astype(np.uint8)
  return np.repeat(np.repeat(rgb_LE3, cell_px, axis=0), cell_px, axis=1)


def read(workdir: str) -> tuple[np.ndarray, np.ndarray]:
  """(steps [S], tokens [S, L, E]) of a run's expert_load.jsonl; a step a
  resumed run logged twice keeps its last record."""
  from foremoe_jax.utils import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  path = os.path.join(workdir, EXPERT_LOAD_FILE)
  by_step = {}
  if os.path.exists(path):
    for r in metrics_lib.read_metrics(path):
      if TOKENS_KEY in r:
        by_step[int(r['step'])] = r[TOKENS_KEY]
  steps = sorted(by_step)
  if not steps:
    return np.zeros((0,), np.int64), np.zeros((0, 0, 0), np.int64)
  return (np.asarray(steps, np.int64),
          np.asarray([by_step[s] for s in steps], np.int64))


def plot(workdir: str, path: str | None = None) -> str | None:
  """expert_load.png of a run: where the tokens went, and how hot it got.

  Left: the heatmap of the whole run's tokens per (MoE layer, expert), over
  each layer's mean (the colours of `heatmap_rgb`). Right: the hottest
  expert's share of its layer's tokens per RL step, one line per layer (the
  median and the range over layers when there are more than 8), against
  the uniform share 1/E. Returns the path, or None without records.
  """
  steps_S, tokens_SLE = read(workdir)
  if not steps_S.size:
    return None
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import matplotlib.ticker  # pylint: disable=g-import-not-at-top,unused-import
  path = path or os.path.join(workdir, 'expert_load.png')
  _, num_layers, num_experts = tokens_SLE.shape
  total_LE = tokens_SLE.sum(axis=0)
  fig, (ax_map, ax_hot) = plt.subplots(
      1, 2, figsize=(12, 4.2), gridspec_kw=dict(width_ratios=[1.1, 1]))
  with np.errstate(divide='ignore'):
    log_LE = np.log2(np.maximum(relative_load(total_LE),
                                2.0 ** -_LOG2_RANGE))
  im = ax_map.imshow(log_LE, cmap='RdBu_r', vmin=-_LOG2_RANGE,
                     vmax=_LOG2_RANGE, aspect='auto', interpolation='nearest')
  bar = fig.colorbar(im, ax=ax_map)
  ticks = np.arange(-_LOG2_RANGE, _LOG2_RANGE + 1)
  bar.set_ticks(ticks)
  bar.set_ticklabels([f'{2.0 ** t:g}x' for t in ticks])
  bar.set_label('tokens / layer mean')
  for axis in (ax_map.xaxis, ax_map.yaxis):
    axis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
  ax_map.set_xlabel('expert')
  ax_map.set_ylabel('MoE layer')
  ax_map.set_title(f'Tokens per expert, summed over steps '
                   f'{steps_S[0]}-{steps_S[-1]}')

  share_SL = tokens_SLE.max(axis=2) / np.maximum(tokens_SLE.sum(axis=2), 1)
  if num_layers <= 8:
    for layer in range(num_layers):
      ax_hot.plot(steps_S, share_SL[:, layer], lw=1.2,
                  label=f'MoE layer {layer}')
  else:
    ax_hot.fill_between(steps_S, share_SL.min(axis=1), share_SL.max(axis=1),
                        alpha=0.25, label='range over layers')
    ax_hot.plot(steps_S, np.median(share_SL, axis=1), lw=1.5,
                label='median over layers')
  ax_hot.axhline(1.0 / num_experts, color='k', ls=':', lw=1,
                 label=f'uniform (1/{num_experts})')
  ax_hot.set_ylim(0, min(1.0, max(2.0 / num_experts,
                                  1.15 * float(share_SL.max()))))
  ax_hot.set_xlabel('RL step')
  ax_hot.set_ylabel("hottest expert's share of the layer's tokens")
  ax_hot.set_title('Hottest expert per layer')
  ax_hot.legend(fontsize=8, loc='best')
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
