"""The RL step: replayed recompute equals the rollout; accumulation is exact."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from foremoe_jax import placement as placement_lib
from foremoe_jax.model import expert_parallel as ep
from foremoe_jax.model import sharding, transformer
from foremoe_jax.rl import step as step_lib
from foremoe_jax.rl import trainer
from foremoe_jax.rollout import sampler as sampler_lib
from foremoe_jax.tasks import get_task


@pytest.fixture(scope='module')
def setup():
  cfg = importlib.import_module('configs.tiny').get_config()
  mesh = ep.make_mesh(1, 8)
  model = transformer.Transformer(cfg.model, mesh, rngs=nnx.Rngs(3))
  graphdef, params = sharding.split_model(model, mesh)
  task = get_task('addition')
  sp = sampler_lib.SamplingParams(max_new_tokens=task.completion_len,
                                  num_generations=4)
  sampler = sampler_lib.Sampler(graphdef, cfg.model, mesh, sp)
  prompts = task.sample_prompts(0, 8)
  rollout = sampler(params, prompts, jax.random.key(0))
  rewards = np.random.default_rng(0).random(32).astype(np.float32)
  return cfg, mesh, graphdef, params, rollout, rewards


def _plan(num_mb, num_layers, spd=2):
  return step_lib.StepPlan(placement_lib.stack_placements(
      [placement_lib.identity_placement(num_layers, 8, 8, spd)] * num_mb), None)


def test_replayed_recompute_equals_rollout_logp(setup):
  cfg, mesh, graphdef, params, rollout, _ = setup
  batch = trainer.rl_batch_from_rollout(rollout, np.zeros(32), [np.arange(32)])
  logp, aux = jax.jit(lambda p, b: step_lib.token_logp(
      graphdef, p, b['tokens_BT'], b['valid_BT'], None, b['routes_LBTK'],
      None))(params, batch)
  mask = batch['loss_mask_BT'] > 0
  assert mask.sum() > 32
  np.testing.assert_allclose(np.asarray(logp)[mask],
                             batch['rollout_logp_BT'][mask], atol=1e-5)
  # The forward with replayed routes uses exactly the recorded routes.
  valid_in = batch['valid_BT'][:, :-1]
  np.testing.assert_array_equal(
      np.asarray(aux.routes_LBTK)[:, valid_in],
      batch['routes_LBTK'][:, valid_in])


@pytest.mark.parametrize('num_mb,shuffle', [(4, False), (8, True)])
def test_accumulated_grads_equal_full_batch(setup, num_mb, shuffle):
  cfg, mesh, graphdef, params, rollout, rewards = setup
  tx = step_lib.make_optimizer(1e-3, 1.0)
  state = step_lib.init_train_state(graphdef, params, tx, mesh, with_ref=True)
  order = (np.random.default_rng(1).permutation(32) if shuffle
           else np.arange(32))
  kw = dict(num_generations=4, eps_low=0.2, eps_high=0.28, beta=0.05)
  num_layers = cfg.model.num_layers

  def grads(mbs):
    batch = trainer.rl_batch_from_rollout(rollout, rewards, mbs)
    batch = jax.tree.map(jnp.asarray, batch)
    plan = _plan(len(mbs), num_layers)
    fn = jax.jit(lambda s, b: step_lib.accumulate_grads(s, b, plan, **kw))
    return fn(state, batch)

  g_full, m_full = grads([np.arange(32)])
  g_acc, m_acc = grads(np.split(order, num_mb))
  leaves_full, leaves_acc = jax.tree.leaves(g_full), jax.tree.leaves(g_acc)
  assert max(float(jnp.abs(x).max()) for x in leaves_full) > 1e-4
  for a, b in zip(leaves_acc, leaves_full):
    np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-4)
  np.testing.assert_allclose(m_acc['loss'], m_full['loss'], atol=1e-6)


def test_step_updates_params_and_compiles_once(setup):
  cfg, mesh, graphdef, params, rollout, rewards = setup
  tx = step_lib.make_optimizer(1e-2, 1.0)
  state = step_lib.init_train_state(graphdef, jax.tree.map(jnp.copy, params),
                                    tx, mesh, with_ref=False)
  rl_step = step_lib.make_rl_step(tx, num_generations=4, eps_low=0.2,
                                  eps_high=0.28, beta=0.0)
  batch = trainer.rl_batch_from_rollout(rollout, rewards,
                                        np.split(np.arange(32), 4))
  before = jax.tree.map(np.asarray, state.params)
  rng = np.random.default_rng(0)
  for _ in range(3):  # New placements every step: same executable.
    from tests.model.test_expert_parallel import random_placement  # pylint: disable=g-import-not-at-top
    del random_placement
    plan = step_lib.StepPlan(placement_lib.stack_placements([
        placement_lib.Placement(
            np.stack([rng.permutation(np.r_[np.arange(8), np.arange(8)])
                      for _ in range(cfg.model.num_layers)]).astype(np.int32),
            np.full((cfg.model.num_layers, 8, 16), 0.5, np.float32))
        for _ in range(4)]), None)
    state, m = rl_step(state, batch, plan)
  assert rl_step._cache_size() == 1
  assert int(state.step) == 3
  assert float(m['grad_norm']) > 0
  moved = [not np.allclose(a, b) for a, b in
           zip(jax.tree.leaves(before), jax.tree.leaves(state.params))]
  assert all(moved)


def test_balance_loss_coef_reaches_router_only_through_its_term(setup):
  cfg, mesh, graphdef, params, rollout, rewards = setup
  tx = step_lib.make_optimizer(1e-3, 1.0)
  state = step_lib.init_train_state(graphdef, params, tx, mesh, with_ref=False)
  batch = jax.tree.map(jnp.asarray, trainer.rl_batch_from_rollout(
      rollout, rewards, [np.arange(32)]))
  plan = _plan(1, cfg.model.num_layers)

  def grads(coef):
    return jax.jit(lambda s, b: step_lib.accumulate_grads(
        s, b, plan, num_generations=4, eps_low=0.2, eps_high=0.28, beta=0.0,
        balance_loss_coef=coef))(state, batch)

  g0, m0 = grads(0.0)
  g1, m1 = grads(1.0)
  assert float(m1['balance_loss']) >= 1.0 - 1e-5  # Switch loss: >= 1, = 1 at balance.
  router = lambda g: g['blocks'][0]['ffn']['router']['kernel'][...]
  assert float(jnp.abs(router(g1) - router(g0)).max()) > 1e-6
  # The last layer's experts feed no router, and replayed routes fix the
  # dispatch: the balance term cannot reach them.
  last = cfg.model.num_layers - 1
  expert = lambda g: g['blocks'][last]['ffn']['w_up'][...]
  np.testing.assert_allclose(expert(g1), expert(g0), atol=1e-7)
