"""PNG plots of the simulated grid: speedup against devices, where time goes."""
from __future__ import annotations

import os

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

COLORS = {'static': '#888888', 'eplb_step': '#1f77b4',
          'eplb_microstep': '#2ca02c', 'foresight_split': '#9467bd',
          'foremoe': '#d62728',
          'foremoe_before_fixes': '#ff9896',
          'foremoe_compute_anchor': '#e377c2'}
PARTS = (('moe_compute_s', 'expert compute'), ('all_to_all_s', 'all-to-all'),
         ('nonexpert_s', 'non-expert compute'),
         ('transfer_exposed_s', 'exposed expert moves'),
         ('plan_wait_s', 'waiting for the plan'),
         ('recompute_s', 'recompute (fwd)'),
         ('grad_sync_s', 'gradient all-reduce'), ('optimizer_s', 'optimizer'))


def _select(rows, **match):
  return [r for r in rows if all(r[k] == v for k, v in match.items())]


def speedup_plot(rows, path: str, profile: str, mode: str,
                 baseline: str = 'static') -> str:
  """Whole-step speedup over `baseline` against device count, a panel per
  model, a line per method."""
  models = sorted({r['model'] for r in rows})
  fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6),
                           squeeze=False)
  for ax, model in zip(axes[0], models):
    for method, color in COLORS.items():
      pts = sorted((r['devices'], r[f'speedup_step_vs_{baseline}'])
                   for r in _select(rows, model=model, profile=profile,
                                    mode=mode, method=method)
                   if f'speedup_step_vs_{baseline}' in r)
      if pts:
        ax.plot(*zip(*pts), 'o-', color=color, label=method)
    ax.set_xscale('log', base=2)
    ax.axhline(1.0, color='k', lw=0.5)
    ax.set_title(model)
    ax.set_xlabel('devices')
  axes[0][0].set_ylabel(f'step speedup vs {baseline}')
  axes[0][-1].legend(fontsize=8)
  fig.suptitle(f'simulated RL step, {profile}, {mode} dispatch')
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def breakdown_plot(rows, path: str, profile: str, mode: str,
                   model: str) -> str:
  """Stacked seconds per part of the step, per method and device count."""
  sel = sorted(_select(rows, model=model, profile=profile, mode=mode),
               key=lambda r: (r['devices'], list(COLORS).index(r['method'])))
  fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(sel)), 4))
  labels = [f"{r['devices']} {r['method']}" for r in sel]
  bottom = [0.0] * len(sel)
  cmap = plt.get_cmap('tab10')
  for i, (key, name) in enumerate(PARTS):
    vals = [r[key] for r in sel]
    ax.bar(range(len(sel)), vals, bottom=bottom, color=cmap(i), label=name)
    bottom = [b + v for b, v in zip(bottom, vals)]
  ax.set_xticks(range(len(sel)))
  ax.set_xticklabels(labels, rotation=70, fontsize=7)
  ax.set_ylabel('seconds per RL step (rollout excluded)')
  ax.set_title(f'where the time goes: {model}, {profile}, {mode} dispatch')
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def write_plots(rows, out_dir: str, profile: str = 'h100') -> list[str]:
  os.makedirs(out_dir, exist_ok=True)
  paths = []
  for mode in sorted({r['mode'] for r in rows}):
    for base in ('static', 'eplb_step'):
      if not any(f'speedup_step_vs_{base}' in r for r in rows):
        continue  # The baseline was not run (--methods).
      paths.append(speedup_plot(
          rows, os.path.join(out_dir, f'speedup_vs_{base}_{profile}_{mode}.png'),
          profile, mode, base))
    for model in sorted({r['model'] for r in rows}):
      paths.append(breakdown_plot(
          rows, os.path.join(out_dir, f'breakdown_{model}_{profile}_{mode}.png'),
          profile, mode, model))
  return paths


def moves_ratio_plot(rows, path: str, profile: str) -> str:
  """experiments.sweep_moves: ForeMoE's step speedup over foresight_split
  (the same foresight without moves) per tokens config, a bar per
  redundant-slot count, a panel per (model, devices); the update alone as
  black ticks. Cells where a method failed have no bar."""
  panels = list(dict.fromkeys((r['model'], r['devices']) for r in rows))
  configs = list(dict.fromkeys((r['seqs_per_microbatch'], r['tokens_per_seq'])
                               for r in rows))
  redundant = sorted({r['redundant_slots_per_device'] for r in rows})
  width = 0.8 / len(redundant)
  cmap = plt.get_cmap('viridis')
  fig, axes = plt.subplots(1, len(panels), squeeze=False,
                           figsize=(max(6.5, 1.8 * len(configs)) * len(panels),
                                    3.8))
  for ax, (model, devices) in zip(axes[0], panels):
    for j, red in enumerate(redundant):
      for i, (seqs, tokens) in enumerate(configs):
        sel = [r for r in rows if r['model'] == model
               and r['devices'] == devices
               and r['redundant_slots_per_device'] == red
               and (r['seqs_per_microbatch'], r['tokens_per_seq'])
               == (seqs, tokens)]
        step = sel[0]['foremoe_vs_foresight_split_step'] if sel else None
        if step is None:
          continue
        x = i + (j - (len(redundant) - 1) / 2) * width
        ax.bar(x, step - 1.0, width, bottom=1.0,
               color=cmap(j / max(1, len(redundant) - 1)),
               label=f'{red} redundant slot(s)' if i == 0 else None)
        ax.plot([x - width / 2, x + width / 2],
                [sel[0]['foremoe_vs_foresight_split_update']] * 2, 'k-',
                lw=1.5, label='update alone' if i == j == 0 else None)
        ax.annotate(f'{step:.3f}', (x, step), ha='center',
                    va='bottom' if step >= 1 else 'top', fontsize=7)
    ax.axhline(1.0, color='k', lw=0.5)
    ax.set_xticks(range(len(configs)))
    ax.set_xticklabels([f'{s} x {t:,}' for s, t in configs])
    ax.set_xlabel('sequences x tokens per device and micro-step')
    ax.set_title(f'{model}, {devices} devices')
    ax.margins(y=0.25)
  axes[0][0].set_ylabel('ForeMoE speedup vs foresight_split')
  axes[0][-1].legend(fontsize=7)
  fig.suptitle(f'what the moves add: simulated RL step, {profile}, exact '
               'dispatch')
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
