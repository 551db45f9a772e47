"""The demo's recorded numbers are the run's files reduced as documented."""
import json

import pytest

from experiments import render_results
from foremoe_jax.benchmarks import demo


def _step(step, **kw):
  """One RL record as the trainer writes it; kw overrides."""
  r = dict(phase='rl', step=step, reward_mean=0.5, step_s=1.0, compile_s=0.0,
           microstep_max_over_mean=[1.0, 1.0],
           microstep_max_over_mean_static=[2.0, 2.0],
           weight_bytes_moved_per_device_per_microstep=1000.0,
           grad_bytes_returned_per_device_per_microstep=500.0,
           plan_s=0.01, plan_wait_s=0.0, recompute_plan_s=0.004,
           capacity=200, capacity_static=400,
           transfer_id_errors=0, dropped=0, reverted_moves=0,
           replay_logp_gap=1e-6)
  r.update(kw)
  return r


def _workdir(tmp_path, records, summary=None):
  config = dict(
      task='addition', eval_prompts=256, warmstart=dict(steps=800),
      model=dict(num_layers=2, num_experts=8, top_k=2),
      parallel=dict(slots_per_device=2, num_data=1, num_expert=8),
      rl=dict(steps=100, prompts_per_step=32, num_generations=8,
              num_microbatches=4),
      planner=dict(method='foremoe'))
  (tmp_path / 'config.json').write_text(json.dumps(config))
  (tmp_path / 'summary.json').write_text(json.dumps(summary or dict(
      greedy_reward_before_rl=0.5, greedy_reward_after_rl=0.75,
      plan_fallbacks=2, compiles=9)))
  lines = [json.dumps(dict(phase='warmstart', step=1, loss=3.0))]
  lines += [json.dumps(r) for r in records]
  (tmp_path / 'metrics.jsonl').write_text('\n'.join(lines) + '\n')
  for name in ('reward.png', 'kl.png'):
    (tmp_path / name).write_bytes(b'png')
  return str(tmp_path)


def test_demo_result_reduces_the_steps_by_hand(tmp_path):
  # 12 steps: rewards 0..11 / 12; step 1 compiled (20 s); step 5 waited
  # 50 ms for its plan; step 7 was logged twice (a resume), the second
  # record counts; steps 3 and 9 moved 4000 B, the rest 1000 B.
  records = []
  for s in range(1, 13):
    records.append(_step(
        s, reward_mean=(s - 1) / 12, step_s=20.0 if s == 1 else 0.1 * s,
        compile_s=19.0 if s == 1 else 0.0,
        microstep_max_over_mean=[1.0, 1.2 if s == 2 else 1.0],
        plan_wait_s=0.05 if s == 5 else 0.0,
        recompute_plan_s=0.002 * s,
        weight_bytes_moved_per_device_per_microstep=(
            4000.0 if s in (3, 9) else 1000.0),
        reverted_moves=1 if s in (4, 6) else 0,
        replay_logp_gap=3e-5 if s == 8 else 1e-6))
    if s == 7:  # The first record of step 7, before a crash.
      records.insert(-1, _step(7, reward_mean=99.0, dropped=5))
  res = demo.demo_result(_workdir(tmp_path, records), wall_s=123.0)
  assert res['steps'] == 12 and res['wall_s'] == 123.0
  # Steps 2..12 compiled nothing: their times are 0.2..1.2, median 0.7.
  assert res['step_s_median'] == pytest.approx(0.7)
  # First 10 rewards 0..9 / 12, last 10 are 2..11 / 12.
  assert res['reward_window'] == 10
  assert res['reward_first'] == pytest.approx(4.5 / 12)
  assert res['reward_last'] == pytest.approx(6.5 / 12)
  # Step 2's mean over micro-steps is 1.1; the others 1.0.
  assert res['microstep_max_over_mean'] == pytest.approx((11 + 1.1) / 12)
  assert res['microstep_max_over_mean_static'] == pytest.approx(2.0)
  assert res['weight_bytes_moved'] == pytest.approx((10 * 1000 + 8000) / 12)
  assert res['steps_waited_for_plan'] == 1
  assert res['plan_wait_s_max'] == pytest.approx(0.05)
  # The step-level plan, on every step's critical path: 2..24 ms, median
  # of the 12 counted records 13 ms.
  assert res['recompute_plan_s_median'] == pytest.approx(0.013)
  assert res['dropped'] == 0  # The replaced record's 5 do not count.
  assert res['reverted_moves'] == 2
  assert res['replay_logp_gap_max'] == pytest.approx(3e-5)
  assert res['greedy_before_rl'] == 0.5 and res['greedy_after_rl'] == 0.75
  assert res['plan_fallbacks'] == 2
  assert res['plots'] == ['kl.png', 'reward.png']
  text = render_results.render_demo(dict(res, train_command='python -m x'))
  assert '**0.750**' in text and '2 min 3 s wall-clock' in text
  assert '0.7 s per GRPO step' in text and 'planner fallbacks: 2' in text
  assert '(steps 3-12)' in text
  assert 'the step-level plan 13.0 ms, made before the recompute' in text


def test_demo_result_needs_a_finished_run(tmp_path):
  with pytest.raises(FileNotFoundError, match='no finished run'):
    demo.demo_result(str(tmp_path))
  workdir = _workdir(tmp_path, [])
  with pytest.raises(ValueError, match='no RL step'):
    demo.demo_result(workdir)
