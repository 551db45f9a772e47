"""The main job's numbers, read back from a finished run's workdir.

Sits after the whole RL loop: `experiments.record_demo` runs
`experiments.rl_train` (what `make demo` runs), then hands its workdir to
`demo_result`, which reads what the trainer wrote there (config.json,
summary.json, metrics.jsonl: one record per RL step) and reduces it to the
few numbers the README quotes. `experiments.render_results` renders them, so
the README's demo numbers are those of a run the repository can repeat, not
typed by hand.

Plain Python and numpy; no jax.
"""
from __future__ import annotations

import json
import os

import numpy as np

from foremoe_jax.utils import metrics as metrics_lib

# Steps averaged at each end of the run for the sampled reward.
REWARD_WINDOW = 10


def _load_json(workdir: str, name: str) -> dict:
  path = os.path.join(workdir, name)
  if not os.path.exists(path):
    raise FileNotFoundError(
        f'{path} is missing: {workdir} holds no finished run (run '
        f'`python -m experiments.rl_train --workdir={workdir}` to the end '
        f'first).')
  with open(path) as f:
    return json.load(f)


def rl_records(workdir: str) -> list[dict]:
  """The RL steps' records, one per step (the last record of a step wins:
  a resumed run may have logged a step twice)."""
  by_step = {}
  for r in metrics_lib.read_metrics(workdir):
    if r.get('phase') == 'rl':
      by_step[r['step']] = r
  return [by_step[s] for s in sorted(by_step)]


def demo_result(workdir: str, wall_s: float | None = None) -> dict:
  """The numbers of one finished run in `workdir`.

  wall_s: the run's wall-clock from the command's start (set-up, warm start
  and compiles included), when the caller timed it; None otherwise.
  """
  config = _load_json(workdir, 'config.json')
  summary = _load_json(workdir, 'summary.json')
  records = rl_records(workdir)
  if not records:
    raise ValueError(f'{workdir}/metrics.jsonl holds no RL step.')
  col = lambda key: np.asarray([r[key] for r in records], np.float64)
  window = min(REWARD_WINDOW, len(records))
  # A step that compiled (its first step, a new capacity bucket) is not
  # what a step costs: the median is over the steps that compiled nothing.
  steady = [r['step_s'] for r in records if not r.get('compile_s')]
  mo, rl, par = config['model'], config['rl'], config['parallel']
  return dict(
      config=dict(
          task=config['task'], num_layers=mo['num_layers'],
          num_experts=mo['num_experts'], top_k=mo['top_k'],
          slots_per_device=par['slots_per_device'],
          num_data=par['num_data'], num_expert=par['num_expert'],
          warmstart_steps=config['warmstart']['steps'],
          rl_steps=rl['steps'], prompts_per_step=rl['prompts_per_step'],
          num_generations=rl['num_generations'],
          num_microbatches=rl['num_microbatches'],
          planner=config['planner']['method'],
          eval_prompts=config['eval_prompts']),
      steps=len(records),
      wall_s=wall_s,
      step_s_median=float(np.median(steady)) if steady else None,
      greedy_before_rl=summary.get('greedy_reward_before_rl'),
      greedy_after_rl=summary.get('greedy_reward_after_rl'),
      reward_window=window,
      reward_first=float(col('reward_mean')[:window].mean()),
      reward_last=float(col('reward_mean')[-window:].mean()),
      # Each step's value is already the mean over its micro-steps.
      microstep_max_over_mean=float(np.mean(
          [np.mean(r['microstep_max_over_mean']) for r in records])),
      microstep_max_over_mean_static=float(np.mean(
          [np.mean(r['microstep_max_over_mean_static']) for r in records])),
      weight_bytes_moved=float(
          col('weight_bytes_moved_per_device_per_microstep').mean()),
      grad_bytes_returned=float(
          col('grad_bytes_returned_per_device_per_microstep').mean()),
      plan_s_median=float(np.median(col('plan_s'))),
      # The step-level plan, made before the recompute is dispatched: on
      # the critical path of every step (the micro-step plan overlaps the
      # recompute).
      recompute_plan_s_median=(float(np.median(col('recompute_plan_s')))
                               if 'recompute_plan_s' in records[0] else None),
      plan_wait_s_max=float(col('plan_wait_s').max()),
      steps_waited_for_plan=int((col('plan_wait_s') > 1e-3).sum()),
      capacity_mean=float(col('capacity').mean()),
      capacity_static_mean=float(col('capacity_static').mean()),
      transfer_id_errors=int(col('transfer_id_errors').sum()),
      dropped=int(col('dropped').sum()),
      reverted_moves=int(col('reverted_moves').sum()),
      replay_logp_gap_max=float(col('replay_logp_gap').max()),
      plan_fallbacks=int(summary.get('plan_fallbacks') or 0),
      compiles=summary.get('compiles'),
      plots=sorted(f for f in os.listdir(workdir) if f.endswith('.png')),
  )
