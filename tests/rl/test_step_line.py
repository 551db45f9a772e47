"""The trainer's per-step log line: a step whose plan fell back says so."""
from foremoe_jax.rl import trainer


def _record(**extra):
  return dict(reward_mean=0.5, kl=0.001, microstep_max_over_mean=[1.0, 1.2],
              microstep_max_over_mean_static=[2.0, 3.0], capacity=96,
              capacity_static=160,
              weight_bytes_moved_per_device_per_microstep=24576.0,
              plan_wait_s=0.0, step_s=1.25, **extra)


def test_step_line_flags_the_plan_fallback_and_why():
  reason = 'deadline 120 ms missed -> step-level plan'
  line = trainer._log_line(7, _record(plan_fallback=True,  # pylint: disable=protected-access
                                      plan_fallback_reason=reason))
  assert line.endswith(f'| 1.25s [plan fell back: {reason}]'), line
  # The rest of the line is the same as on a step without a fallback.
  plain = trainer._log_line(7, _record(plan_fallback=False,  # pylint: disable=protected-access
                                       plan_fallback_reason=''))
  assert plain.endswith('| 1.25s') and 'fell back' not in plain
  assert line.startswith(plain)
  assert 'micro-step max/mean 1.100 (static 2.500)' in plain
  # Records of older runs carry no flag: no note.
  assert trainer._log_line(7, _record()) == plain  # pylint: disable=protected-access
