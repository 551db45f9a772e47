"""The scale-out grid: every model x device count x method, and its summary.

For each (model, device count) one synthetic trace of two RL steps is made
for one EP group (step 0 feeds EPLB-step's history, step 1 is scored),
every method plans step 1 with the repository's planner (timed on this
host), and `simulate.time_step` predicts the device side on each hardware
profile and dispatch mode. Plans are made with the first profile's cost
model and re-timed on the others. Device counts above the expert count
reuse the plans of the largest EP group (groups beside it are data
parallel and only change the gradient all-reduce).
"""
from __future__ import annotations

import dataclasses
import functools
import time

from foremoe_jax.foresight import traces
from foremoe_jax.planner import baselines
from foremoe_jax.sim import simulate
from foremoe_jax.sim.hardware import HardwareProfile
from foremoe_jax.sim.workload import (Workload, load_model_config,
                                     load_model_shape, synthetic_loads)

DEVICE_COUNTS = (8, 16, 32, 64, 128, 256)
# Methods whose host planning is hopeless past some EP size: EPLB per
# micro-step re-packs every micro-step from scratch, so almost all of its
# moves exceed the round budget and fitting them back takes minutes (99 s
# for DeepSeek-V3-like at 128 devices on this host, about D^2 growth).
SKIP_ABOVE = {'eplb_microstep': 128}
MODELS = ('qwen3_30b_a3b', 'deepseek_v3_like', 'mixtral_8x7b')


def check_trace(trace: traces.Trace, model, ep: int, num_micro: int):
  """A recorded trace must match the model and EP group it stands for."""
  _, m, l, d, e = trace.loads_RMLDE.shape
  want = (num_micro, model.num_moe_layers, ep, model.num_experts)
  if trace.num_steps < 2 or (m, l, d, e) != want:
    raise ValueError(
        f'trace [R, M, L, D, E] = {list(trace.loads_RMLDE.shape)} does not '
        f'fit {model.name} on an EP group of {ep}: need R >= 2 and (M, L, D, '
        f'E) = {want}.')


def run_grid(models=MODELS, device_counts=DEVICE_COUNTS,
             profiles: tuple[HardwareProfile, ...] = (),
             methods=simulate.METHODS, modes=simulate.MODES,
             work_kwargs: dict | None = None, seed: int = 0,
             trace: traces.Trace | None = None, skip_above=None,
             transfer_mode: str = 'exact', planner_workers: int = 1,
             prefill: bool = True, deadlines: bool = True,
             log=print) -> list[dict]:
  """One row per (model, devices, profile, mode, method).

  planner_workers: the planner's processes (`StepPlanner(workers=...)`),
  as the trainer's `planner.workers`; the rows' plan seconds are measured
  with them on this host.

  transfer_mode: the transfer schedule's (`schedule.MODES`): ``exact``
  (ragged all-to-all of the experts that move) or ``rounds``.

  prefill: the recompute fills the update's slots under its forward
  (`transfer.prefill`, the trainer's default) wherever the workload runs a
  recompute; False: the update opens with the whole fill.

  deadlines: each update plan runs under the deadline the model config's
  planner sets the trainer's (`simulate.plan_deadline`, on the first
  profile): layers still planning then take the recompute's step-level
  plan, and the step waits no longer. False: every plan runs to its end.

  trace: recorded loads (e.g. the sampler's, `traces.trace_from_step_loads`)
  used instead of a synthetic trace wherever its shape fits (step 0 feeds
  EPLB-step's history, step 1 is scored); see `check_trace`.
  """
  if not profiles:
    raise ValueError('run_grid needs at least one hardware profile.')
  skip_above = SKIP_ABOVE if skip_above is None else skip_above
  rows = []
  for name in models:
    model = load_model_shape(name)
    cache = {}
    for num_dev in device_counts:
      work = Workload(num_dev, **(work_kwargs or {}))
      ep = work.ep_size(model)
      if ep not in cache:
        t0 = time.perf_counter()
        if trace is not None and trace.loads_RMLDE.shape[3:] == (
            ep, model.num_experts):
          check_trace(trace, model, ep, work.num_microsteps)
          loads = trace
        else:
          loads = synthetic_loads(model, work, seed=seed)
        topo = simulate.topology(model, work, profiles[0])
        history = baselines.update_history(None, loads.step(0), 0.5)
        deadline_of = None
        if deadlines:
          # The model config's planner deadline, on the first profile (the
          # one the plans are made for), as the trainer sets it.
          pcfg = load_model_config(name).planner
          deadline_of = functools.partial(
              simulate.plan_deadline, loads_MLDE=loads.step(1), model=model,
              work=work, hw=profiles[0], deadline_ms=pcfg.deadline_ms,
              recompute_frac=pcfg.get('deadline_recompute_frac', 1.0))
        plans = simulate.plan_methods(
            loads.step(1), history, topo, simulate.cost_model(model, profiles[0]),
            simulate.default_budget(topo, transfer_mode), model.top_k,
            work.tokens_per_device,
            [m for m in methods if ep <= skip_above.get(m, ep)],
            workers=planner_workers,
            prefill=prefill and work.recompute_forward_passes > 0,
            deadline_of=deadline_of)
        cache[ep] = (loads.step(1), plans)
        log(f'{name}: EP {ep} planned in {time.perf_counter() - t0:.1f}s ('
            + ', '.join(f'{m} {p.plan_s:.2f}s' for m, p in plans.items()) + ')')
      loads, plans = cache[ep]
      for hw in profiles:
        for mode in modes:
          for method, mp in plans.items():
            r = simulate.time_step(mp, loads, model, work, hw, mode)
            rows.append(dict(model=name, devices=num_dev, ep=ep,
                             profile=hw.name, mode=mode, method=method,
                             transfer_mode=transfer_mode,
                             planner_workers=planner_workers, **r))
  _add_speedups(rows)
  return rows


def _add_speedups(rows):
  by_key = {}
  for r in rows:
    by_key.setdefault((r['model'], r['devices'], r['profile'], r['mode']),
                      {})[r['method']] = r
  for group in by_key.values():
    for r in group.values():
      for base in ('static', 'eplb_step', 'foresight_split'):
        if base in group:
          r[f'speedup_update_vs_{base}'] = group[base]['update_s'] / r['update_s']
          r[f'speedup_step_vs_{base}'] = group[base]['step_s'] / r['step_s']


def find(rows, **match) -> dict:
  for r in rows:
    if all(r.get(k) == v for k, v in match.items()):
      return r
  raise KeyError(f'no simulated row with {match}.')


def headline(rows, model='qwen3_30b_a3b', devices=64, profile='h100') -> dict:
  """ForeMoE at 64 H100-class GPUs on Qwen3-30B-A3B: the default dispatch
  (named in `dispatch_64gpu`) unsuffixed, the padded one `_padded`."""
  out = {'dispatch_64gpu': simulate.DEFAULT_MODE}
  for mode in simulate.MODES:
    try:
      r = find(rows, model=model, devices=devices, profile=profile, mode=mode,
               method='foremoe')
    except KeyError:
      continue
    suffix = '' if mode == simulate.DEFAULT_MODE else f'_{mode}'
    for base in ('static', 'eplb_step', 'foresight_split'):
      if f'speedup_step_vs_{base}' in r:
        out[f'speedup_64gpu_foremoe_vs_{base}{suffix}'] = r[
            f'speedup_step_vs_{base}']
        out[f'update_speedup_64gpu_foremoe_vs_{base}{suffix}'] = r[
            f'speedup_update_vs_{base}']
    out[f'peak_bytes_per_device_64gpu{suffix}'] = r['peak_bytes_per_device']
    out[f'step_s_64gpu_foremoe{suffix}'] = r['step_s']
    out[f'all_to_all_share_of_update_64gpu_foremoe{suffix}'] = (
        r['all_to_all_s'] / r['update_s'])
    out[f'sender_max_over_mean_64gpu{suffix}'] = r['sender_max_over_mean']
    for key in simulate.TRAFFIC_KEYS:
      if r.get(key) is not None:  # The exact dispatch's rows by node.
        out[f'{key}_64gpu_foremoe{suffix}'] = r[key]
    out[f'wire_bytes_over_useful_64gpu_foremoe{suffix}'] = r[
        'wire_bytes_over_useful']
    out[f'transfer_exposed_share_of_update_64gpu_foremoe{suffix}'] = (
        r['transfer_exposed_s'] / r['update_s'])
    out[f'microstep_max_over_mean_64gpu_foremoe{suffix}'] = r[
        'microstep_max_over_mean']
    try:
      eplb = find(rows, model=model, devices=devices, profile=profile,
                  mode=mode, method='eplb_step')
      out[f'microstep_max_over_mean_64gpu_eplb_step{suffix}'] = eplb[
          'microstep_max_over_mean']
      for key in simulate.TRAFFIC_KEYS[1:]:  # Receives and on-node share.
        if eplb.get(key) is not None:
          out[f'{key}_64gpu_eplb_step{suffix}'] = eplb[key]
    except KeyError:
      pass
    try:  # The ablation: the anchor blind to where tokens come from.
      blind = find(rows, model=model, devices=devices, profile=profile,
                   mode=mode, method='foremoe_compute_anchor')
      out[f'speedup_64gpu_foremoe_vs_compute_anchor{suffix}'] = (
          blind['step_s'] / r['step_s'])
      for key in simulate.TRAFFIC_KEYS:
        if blind.get(key) is not None:
          out[f'{key}_64gpu_compute_anchor{suffix}'] = blind[key]
    except KeyError:
      pass
  return out


def transfer_summary(rows, mode: str = simulate.DEFAULT_MODE) -> dict:
  """The transfer engine over the grid (one dispatch mode): its schedule
  mode, the worst wire / useful ratio of any row, and per EP size the
  largest share of the update its exposed transfers take."""
  rows = [r for r in rows if r['mode'] == mode]
  if not rows:
    return {}
  exposed = {}
  for r in rows:
    k = str(r['devices'])
    exposed[k] = max(exposed.get(k, 0.0),
                     r['transfer_exposed_s'] / r['update_s'])
  # Where the worst row at the most devices loses its seconds.
  most = max(r['devices'] for r in rows)
  worst = max((r for r in rows if r['devices'] == most),
              key=lambda r: r['transfer_exposed_s'] / r['update_s'])
  parts = {k: worst.get(k, 0.0) for k in (
      'update_s', 'transfer_exposed_s', 'fill_s', 'flush_s',
      'flush_exposed_s', 'prefill_s', 'prefill_exposed_s')}
  parts['moves_exposed_s'] = max(0.0, worst['transfer_exposed_s']
                                 - parts['fill_s'] - parts['flush_exposed_s']
                                 - parts['prefill_exposed_s'])
  return dict(transfer_mode=rows[0].get('transfer_mode', 'exact'),
              wire_bytes_over_useful_max=max(r['wire_bytes_over_useful']
                                             for r in rows),
              transfer_exposed_share_of_update_max=exposed,
              transfer_exposed_worst=dict(
                  model=worst['model'], devices=most, method=worst['method'],
                  profile=worst['profile'], **parts))


def planning_summary(rows, method: str = 'foremoe',
                     mode: str = simulate.DEFAULT_MODE) -> dict:
  """Host planning against the recompute it hides behind, per model at
  its largest EP group (first profile's rows): the micro-step plan's
  seconds (`plan_s`, with fit and schedule), the step-level plan's that
  precede the recompute (`recompute_plan_s`), the recompute's, the
  planner's processes, and plan_s / recompute_s (the target is <= 0.5)."""
  rows = [r for r in rows if r['mode'] == mode and r['method'] == method]
  if not rows:
    return {}
  profile = rows[0]['profile']
  out = {}
  for r in rows:
    if r['profile'] != profile:
      continue
    best = out.get(r['model'])
    if best is None or r['ep'] > best['ep']:
      out[r['model']] = dict(
          ep=r['ep'], devices=r['devices'], plan_s=r['plan_s'],
          recompute_plan_s=r['recompute_plan_s'],
          recompute_s=r['recompute_s'], plan_wait_s=r['plan_wait_s'],
          plan_over_recompute=r['plan_s'] / r['recompute_s'],
          planner_workers=r.get('planner_workers', 1))
  return {'planning_largest_ep': out}


def workload_description(work_kwargs: dict | None) -> dict:
  return dataclasses.asdict(Workload(8, **(work_kwargs or {})))
