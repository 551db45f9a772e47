"""Where ForeMoE's per-micro-step expert moves beat foresight_split.

  python -m experiments.sweep_moves --json

foresight_split is ForeMoE without moves: the step-level placement from
the step's exact loads and a per-micro-step token split over its replicas.
What moving experts between micro-steps adds depends on room for replicas
(redundant slots per device) and on how far one micro-step's loads stray
from the step's (tokens per device per micro-step: one 32k-token sequence,
2 x 4k or 8 x 1k), and on the model (by default Qwen3-30B-A3B, 128
experts top-8, and Mixtral-8x7B, 8 experts top-2, each on 8 and 64
devices). For every (model, devices, redundant slots, tokens) cell the
simulated cluster (`foremoe_jax.sim.cluster.run_grid`, exact-count dispatch) plans
one step with each method and predicts its times; each output row holds
the methods' step and update seconds, ForeMoE's ratio to foresight_split
(above 1: the moves pay), where the difference goes (ForeMoE minus
foresight_split: expert compute, all-to-all, exposed moves), and ForeMoE's
transfer figures. A method that cannot run in a cell is named in the
row's `errors` with why, and its entries are None.

With no redundant slot (s = E / D) every slot holds its home expert and no
expert has a second replica to give up, so ForeMoE has nothing to move and
its device side is foresight_split's (and static EP's): those rows show
the harness's floor.

Step seconds include planning measured on this host (the recompute's
step-level plan, the same code for both methods, and any wait for the
micro-step plan), so step ratios within `step_timing_noise_max` of 1 (the
largest gap between the two methods' step-level planning times, as a
share of the step) are timing noise; the update ratio is device-side only
and deterministic.

The summary counts the cells where the moves win, names the best and the
worst, and says whether 1.05x is reached anywhere. Outputs:
results/sweep_moves.json (run info, summary, rows, the grid's own rows)
and a PNG of the step ratio per cell in --out_dir;
`python -m experiments.render_results` renders the table. The last line
printed is the summary as one JSON object.
"""
from __future__ import annotations

import json
import os
import time

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

from absl import app, flags, logging  # pylint: disable=g-import-not-at-top

from foremoe_jax.sim import cluster, hardware, plots, simulate  # pylint: disable=g-import-not-at-top
from foremoe_jax.sim.workload import Workload, load_model_shape  # pylint: disable=g-import-not-at-top
from foremoe_jax.utils import results  # pylint: disable=g-import-not-at-top
from foremoe_jax.utils.run_info import print_run_info  # pylint: disable=g-import-not-at-top

REDUNDANT = (0, 1, 2)
# (sequences, tokens per sequence) per device and micro-step: 32,768 tokens
# in one sequence, or 8,192 as 2 x 4k or 8 x 1k.
TOKEN_CONFIGS = ((1, 32768), (2, 4096), (8, 1024))
METHODS = ('static', 'eplb_step', 'foresight_split', 'foremoe')
# ForeMoE minus foresight_split, per part of the step: where the moves'
# gain or loss comes from.
DELTA_PARTS = ('moe_compute_s', 'all_to_all_s', 'transfer_exposed_s',
               'recompute_s', 'plan_wait_s', 'recompute_plan_s')
TARGET_RATIO = 1.05


def row_key(model: str, devices: int, redundant: int, seqs: int,
            tokens_per_seq: int) -> str:
  return f'{model}/{devices}dev/r{redundant}/{seqs}x{tokens_per_seq}'


def _one_line(err: BaseException) -> str:
  return ' '.join(f'{type(err).__name__}: {err}'.split())


def cell_grid_rows(model: str, devices: int, profile, methods, work_kwargs,
                   seed: int = 0, log=print) -> tuple[list[dict], dict]:
  """run_grid's rows for one cell (exact dispatch), and {method: why} for
  methods that could not run: when the cell fails as a whole, each method
  is run alone so one failure costs only its own row entries."""
  grid = lambda ms: cluster.run_grid(
      (model,), (devices,), (profile,), tuple(ms), modes=('exact',),
      work_kwargs=work_kwargs, seed=seed, log=log)
  try:
    return grid(methods), {}
  except Exception:  # pylint: disable=broad-except
    pass
  rows, errors = [], {}
  for m in methods:
    try:
      rows += grid((m,))
    except Exception as err:  # pylint: disable=broad-except
      errors[m] = _one_line(err)
  return rows, errors


def _ratio(rows_by_method, key):
  split, fm = rows_by_method.get('foresight_split'), rows_by_method.get(
      'foremoe')
  if split is None or fm is None:
    return None
  return split[key] / fm[key]


def sweep_row(model: str, devices: int, redundant: int, seqs: int,
              tokens_per_seq: int, grid_rows: list[dict], errors: dict,
              methods=METHODS) -> dict:
  """One cell's row from its run_grid rows (one per method)."""
  by = {r['method']: r for r in grid_rows}
  fm, split = by.get('foremoe'), by.get('foresight_split')
  get = lambda k: {m: (by[m][k] if m in by else None) for m in methods}
  row = dict(
      key=row_key(model, devices, redundant, seqs, tokens_per_seq),
      model=model, devices=devices,
      ep=grid_rows[0]['ep'] if grid_rows else None,
      redundant_slots_per_device=redundant, seqs_per_microbatch=seqs,
      tokens_per_seq=tokens_per_seq,
      tokens_per_device=seqs * tokens_per_seq,
      step_s=get('step_s'), update_s=get('update_s'), plan_s=get('plan_s'),
      foremoe_vs_foresight_split_step=_ratio(by, 'step_s'),
      foremoe_vs_foresight_split_update=_ratio(by, 'update_s'),
      microstep_max_over_mean={m: by[m]['microstep_max_over_mean']
                               for m in ('foresight_split', 'foremoe')
                               if m in by},
      errors=dict(errors))
  if fm is not None:
    row.update(
        foremoe_transfer_exposed_s=fm['transfer_exposed_s'],
        foremoe_wire_bytes_over_useful=fm['wire_bytes_over_useful'],
        # Seconds of moves between micro-steps (hidden or not): 0 when
        # ForeMoE made none.
        foremoe_move_s=fm['moves_s'],
        foremoe_capacity=fm['capacity'])
  if fm is not None and split is not None:
    row['foremoe_minus_split_s'] = {k: fm[k] - split[k] for k in DELTA_PARTS}
  return row


def run_sweep(models=('qwen3_30b_a3b',), device_counts=(64,),
              profile=hardware.H100, num_microsteps: int = 8,
              redundant=REDUNDANT, token_configs=TOKEN_CONFIGS,
              methods=METHODS, seed: int = 0,
              log=print) -> tuple[list[dict], list[dict]]:
  """(rows, grid_rows): one row per (model, devices, redundant slots,
  tokens config), and the run_grid rows they were made from (each with
  the cell's `key`)."""
  for name in models:  # Bad shapes fail here, in one line, before any work.
    model = load_model_shape(name)
    for d in device_counts:
      Workload(d).ep_size(model)
  cells = [(m, d, r, s, t) for m in models for d in device_counts
           for r in redundant for s, t in token_configs]
  rows, all_grid = [], []
  for i, (model, devices, r, seqs, tokens) in enumerate(cells):
    t0 = time.perf_counter()
    work_kwargs = dict(num_microsteps=num_microsteps,
                       seqs_per_microbatch=seqs, tokens_per_seq=tokens,
                       redundant_slots_per_device=r)
    grid, errors = cell_grid_rows(model, devices, profile, methods,
                                  work_kwargs, seed, log)
    row = sweep_row(model, devices, r, seqs, tokens, grid, errors, methods)
    rows.append(row)
    all_grid += [dict(g, key=row['key']) for g in grid]
    ratio = row['foremoe_vs_foresight_split_step']
    log(f"[{i + 1}/{len(cells)}] {row['key']}: foresight_split "
        f"{row['step_s'].get('foresight_split') or float('nan'):.3f}s "
        f"foremoe {row['step_s'].get('foremoe') or float('nan'):.3f}s, "
        f"ratio step {ratio or float('nan'):.4f} update "
        f"{row['foremoe_vs_foresight_split_update'] or float('nan'):.4f} "
        f"({time.perf_counter() - t0:.1f}s)"
        + (f'; failed: {errors}' if errors else ''))
  return rows, all_grid


def summarize(rows: list[dict]) -> dict:
  """Cells where the moves win, the best and worst ratio and their cells."""
  scored = [r for r in rows
            if r['foremoe_vs_foresight_split_step'] is not None]
  out = dict(
      rows=len(rows), rows_scored=len(scored),
      rows_where_moves_win=sum(r['foremoe_vs_foresight_split_step'] > 1.0
                               for r in scored),
      rows_where_moves_win_update=sum(
          r['foremoe_vs_foresight_split_update'] > 1.0 for r in scored),
      rows_where_moves_lose_update=sum(
          r['foremoe_vs_foresight_split_update'] < 1.0 for r in scored),
      rows_with_errors=[r['key'] for r in rows if r['errors']])
  if scored:
    best = max(scored, key=lambda r: r['foremoe_vs_foresight_split_step'])
    worst = min(scored, key=lambda r: r['foremoe_vs_foresight_split_step'])
    out.update(
        best_foremoe_vs_foresight_split_step=best[
            'foremoe_vs_foresight_split_step'],
        best_row_key=best['key'],
        min_foremoe_vs_foresight_split_step=worst[
            'foremoe_vs_foresight_split_step'],
        min_row_key=worst['key'],
        best_foremoe_vs_foresight_split_update=max(
            r['foremoe_vs_foresight_split_update'] for r in scored),
        min_foremoe_vs_foresight_split_update=min(
            r['foremoe_vs_foresight_split_update'] for r in scored),
        meets_1_05_in_some_row=best['foremoe_vs_foresight_split_step']
        >= TARGET_RATIO,
        # Both methods make the recompute's step-level plan with the same
        # code on the same loads: the gap between their measured times is
        # host timing noise, and step ratios closer to 1 than this mean
        # nothing.
        step_timing_noise_max=max(
            abs(r['foremoe_minus_split_s']['recompute_plan_s'])
            / r['step_s']['foremoe'] for r in scored))
  return out


def _define_flags() -> dict:
  """The program's flags, defined only when it runs as a program: tests
  import this module beside experiments.render_results, whose
  --results_dir would clash with experiments.common's."""
  from experiments import common  # pylint: disable=g-import-not-at-top
  return dict(
      json=flags.DEFINE_bool('json', False,
                             'Print only setup + one JSON line (progress '
                             'on stderr).'),
      models=flags.DEFINE_list('models', ['qwen3_30b_a3b', 'mixtral_8x7b'],
                              'Model shapes.'),
      devices=flags.DEFINE_list('devices', ['8', '64'], 'Device counts.'),
      profile=flags.DEFINE_string('profile', 'h100', 'Hardware profile.'),
      microsteps=flags.DEFINE_integer('microsteps', 8,
                                      'Micro-steps per RL step.'),
      out_dir=flags.DEFINE_string('out_dir', '', 'Where the PNG goes; '
                                  'empty: <results_dir>/sweep_moves (none '
                                  'when --results_dir is empty too).'),
      results_dir=common.RESULTS_DIR)


def main(argv, f: dict):
  del argv
  from experiments import common  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.WARNING)
  profile = hardware.get_profile(f['profile'].value)
  models, micro = f['models'].value, f['microsteps'].value
  devices = tuple(int(d) for d in f['devices'].value)
  run = print_run_info({
      'experiment': 'sweep_moves', 'models': models,
      'device_counts': devices, 'profile': profile.name,
      'methods': list(METHODS), 'dispatch': simulate.DEFAULT_MODE,
      'num_microsteps': micro, 'redundant_slots': list(REDUNDANT),
      'token_configs': [list(c) for c in TOKEN_CONFIGS]})
  log = common.progress(f['json'].value)
  t0 = time.perf_counter()
  rows, grid_rows = run_sweep(models, devices, profile, micro, log=log)
  out_dir, pngs = common.plot_dir(f['out_dir'].value, 'sweep_moves'), []
  if out_dir:
    os.makedirs(out_dir, exist_ok=True)
    pngs.append(plots.moves_ratio_plot(
        rows, os.path.join(out_dir, 'foremoe_vs_foresight_split_step.png'),
        profile.name))
  summary = {
      **summarize(rows),
      'target_ratio': TARGET_RATIO,
      'assumptions': {
          'profile': hardware.describe(profile),
          'dispatch': simulate.DEFAULT_MODE,
          'num_microsteps': micro,
          'trace': 'synthetic (foremoe_jax/sim/workload.HOT_SHARE), seed 0',
          'planner_time': 'measured on this host, one thread; in step_s',
      },
      'plots': pngs,
      'seconds': time.perf_counter() - t0,
  }
  # Every row goes to the file; the printed line is the summary alone.
  path = results.save('sweep_moves', run,
                      {'summary': summary, 'rows': rows,
                       'grid_rows': grid_rows},
                      results_dir=f['results_dir'].value)
  if path:
    print(f'# saved: {path}')
  print(json.dumps(summary, default=float))


if __name__ == '__main__':
  _FLAGS = _define_flags()
  app.run(lambda argv: main(argv, _FLAGS))
