"""The recompute's plan: the method's step-level placement, made at once.

Static EP recomputes on its home layout (no transfer); a foresight method
recomputes on the step's exact-load placement, so its busiest device
receives fewer rows than static's on skewed loads; a step with nothing to
recompute gets no plan at all.
"""
import importlib

import jax
import numpy as np
from flax import nnx

from foremoe_jax import placement as placement_lib
from foremoe_jax.model import expert_parallel as ep
from foremoe_jax.model import transformer
from foremoe_jax.rl import step as step_lib
from foremoe_jax.rl import trainer
from foremoe_jax.tasks import task_from_config


def _ctx(method, beta=0.01, mu=1):
  cfg = importlib.import_module('configs.tiny').get_config()
  cfg.planner.method = method
  cfg.rl.beta, cfg.rl.num_update_epochs = beta, mu
  mesh = ep.make_mesh(1, 8)
  graphdef = nnx.split(nnx.eval_shape(lambda: transformer.Transformer(
      cfg.model, mesh, rngs=nnx.Rngs(0))))[0]
  return trainer.make_rl_context(cfg, graphdef, mesh, task_from_config(cfg))


def _skewed_loads(num_micro=4, seed=0):
  """[M, G=1, L, D, E]: expert 0 and 1 (home: device 0) take half of every
  source's assignments."""
  rng = np.random.default_rng(seed)
  loads = rng.integers(5, 15, (num_micro, 1, 2, 8, 8))
  loads[..., :2] += 60
  return loads


def test_foresight_method_recomputes_balanced_static_at_home():
  loads = _skewed_loads()
  rows = {}
  for method in ('static', 'foremoe', 'foresight_split'):
    ctx = _ctx(method)
    try:
      rp = trainer.recompute_plan(ctx, loads)
    finally:
      ctx.planner.close()
    assert rp.capacity in ctx.buckets and rp.plan_s >= 0
    if method == 'static':
      assert isinstance(rp.device, step_lib.CanonicalLayout)
      assert rp.plan is None
      placements = [ctx.identity] * loads.shape[0]
    else:
      assert isinstance(rp.device, step_lib.StepPlan)
      se = rp.plan.placement.slot_expert
      # One placement for every micro-step: no moves inside the recompute.
      assert (se == se[:1]).all()
      assert rp.transfer.steps.remote_fills_L.sum() == 0
      placements = [rp.plan.microstep(m) for m in range(loads.shape[0])]
    for p in placements:
      placement_lib.validate_placement(p, 8)
    rows[method] = max(placement_lib.max_received(loads[m], p)
                       for m, p in enumerate(placements))
    assert rp.capacity >= rows[method]
  assert rows['foremoe'] < rows['static'] / 2
  assert rows['foresight_split'] < rows['static'] / 2


def test_no_recompute_no_plan():
  ctx = _ctx('foremoe', beta=0.0, mu=1)
  try:
    rp = trainer.recompute_plan(ctx, _skewed_loads())
  finally:
    ctx.planner.close()
  assert rp.device is None and rp.capacity == 0


def test_rollout_logps_give_way_to_a_recompute_past_the_gap(capsys):
  """With two update epochs and the sampler's log-probs as the old ones, a
  step whose gap exceeds rl.old_logp_max_gap switches the run to
  recomputing them (one more forward from then on), and says so."""
  ctx = _ctx('foremoe', beta=0.0, mu=2)
  ctx.planner.close()
  ctx.config.rl.old_logp_max_gap = 1e-3
  rl_step = ctx.rl_step
  rl_step.old_logp_source = 'rollout'
  assert rl_step.recompute_forward_passes() == 0
  trainer.check_rollout_logps(ctx, 2e-5, step=3)  # Rounding: kept.
  assert rl_step.old_logp_source == 'rollout'
  trainer.check_rollout_logps(ctx, 5e-3, step=4)
  assert rl_step.old_logp_source == 'recompute'
  assert rl_step.recompute_forward_passes() == 1
  assert 'step 4: the sampler' in capsys.readouterr().out
  # Saved with the host state, so a resumed run keeps recomputing.
  assert trainer.host_state(np.random.default_rng(0), jax.random.key(0),
                            rl_step=rl_step)['old_logp_source'] == 'recompute'
