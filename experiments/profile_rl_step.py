"""Where the RL update's time goes, per planner method, by kind of op.

  python -m experiments.profile_rl_step --json

Sets up bench_rl_step's step (same model, warm start, rollout, planners),
then per method plans it as the trainer does, runs the compiled update
once, and traces a second run with jax.profiler. Each op's exclusive time
is summed by category (`foremoe_jax/utils/op_profile.py`): expert_ffn (the
grouped SwiGLU after dispatch, what balance shrinks), matmul (every other
dot), collective, copy (slices, copies, broadcasts: data moved without
arithmetic) and other. Prints the setup, a line per method (unless
--json), then one JSON line: {"methods": {method: {"update_s",
"shares": {category: share}, "top_ops": [...]}}, "devices", ...}, also
written to results/profile_rl_step.json.

On simulated CPU devices the threads share the host's cores: read the
shares, not the seconds (update_s is the traced run's wall clock, which
the tracing itself slows).
"""
import dataclasses
import os
import tempfile
import time

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
from absl import app, flags, logging  # pylint: disable=g-import-not-at-top

from experiments import common  # pylint: disable=g-import-not-at-top
from foremoe_jax.benchmarks import rl_step  # pylint: disable=g-import-not-at-top
from foremoe_jax.utils import op_profile  # pylint: disable=g-import-not-at-top
from foremoe_jax.utils.run_info import print_run_info  # pylint: disable=g-import-not-at-top

_JSON = flags.DEFINE_bool('json', False, 'Print only setup + one JSON line '
                          '(progress on stderr).')
_METHODS = flags.DEFINE_list('methods', ['static', 'foremoe'],
                             f'Planner methods, of {", ".join(rl_step.METHODS)}.')
_WARM = flags.DEFINE_integer('warmstart_steps', 100,
                             'SFT steps before sampling (skews the routing).')
_TOP = flags.DEFINE_integer('top_ops', 10, 'Costliest ops listed per method.')


def profile_method(prep, method: str, top: int) -> dict:
  """Plans the step, compiles and runs the update, traces a second run."""
  fresh = lambda: jax.block_until_ready(  # The update donates its state.
      jax.tree.map(jnp.copy, prep.state0))
  state = fresh()
  logps, _, planned, plan, _ = rl_step.planned_step(prep, method, state)
  compiled = prep.ctx.rl_step.update.lower(state, prep.batch, logps,
                                           plan).compile()
  jax.block_until_ready(compiled(state, prep.batch, logps, plan))
  state = fresh()
  trace_dir = tempfile.mkdtemp(prefix=f'profile_{method}_')
  with jax.profiler.trace(trace_dir):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(state, prep.batch, logps, plan))
    update_s = time.perf_counter() - t0
  excl, count = op_profile.exclusive_seconds(
      op_profile.device_thread_events(trace_dir))
  out = op_profile.breakdown(excl, count,
                             op_profile.hlo_op_names(compiled.as_text()),
                             top=top)
  return dict(update_s=update_s, capacity=planned.capacity, **out)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  bad = sorted(set(_METHODS.value) - set(rl_step.METHODS))
  if bad:
    raise app.UsageError(f'--methods: unknown {", ".join(bad)}; choose from '
                         f'{", ".join(rl_step.METHODS)}.')
  cfg = rl_step.RLStepBench(warmstart_steps=_WARM.value)
  run = print_run_info({'experiment': 'profile_rl_step',
                        'methods': list(_METHODS.value),
                        **dataclasses.asdict(cfg)})
  log = common.progress(_JSON.value)
  prep = rl_step.prepare(cfg, log, methods=_METHODS.value)
  methods = {}
  for method in _METHODS.value:
    r = profile_method(prep, method, _TOP.value)
    methods[method] = r
    log(f'{method}: update {r["update_s"]:.2f}s traced; ' + ', '.join(
        f'{c} {100 * v:.0f}%' for c, v in r['shares'].items()))
  for p in prep.planners.values():
    p.close()
  common.finish('profile_rl_step', run, dict(
      devices=jax.device_count(), categories=list(op_profile.CATEGORIES),
      methods=methods))


if __name__ == '__main__':
  app.run(main)
