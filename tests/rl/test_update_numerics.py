"""Numerics of the update: bf16 training with float32 master weights and
float32 gradient sums.

One module so the float32 update compiles once for all (compiles dominate).
"""
import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import rl_testlib as lib
from foremoe_jax.rl import step as step_lib

M = 4  # Micro-steps.
BF16_EPS = 2.0 ** -8  # Spacing of bfloat16 at 1 (8 significant bits).
F32_UNIT = 2.0 ** -24  # float32 unit roundoff.


@pytest.fixture(scope='module')
def setup():
  cfg_b, cfg_f = lib.mini_config('bfloat16'), lib.mini_config('float32')
  mesh, gd_b, params_b = lib.build(cfg_b)
  gd_f = lib.graphdef_of(cfg_f, mesh)
  batch, plan = lib.synthetic_batch(M), lib.moving_plan(M)
  kw = lib.LOSS_KW
  tx = step_lib.make_optimizer(1e-3, 1.0)

  def apply(params, opt_state, grads):  # One AdamW step, as RLStep takes it.
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  fns = dict(
      recompute=jax.jit(step_lib.recompute_logps, static_argnums=2),
      grads=jax.jit(lambda s, b, l, p: step_lib.update_grads(s, b, l, p, **kw)),
      apply=jax.jit(apply))
  return dict(mesh=mesh, gd_b=gd_b, params_b=params_b, gd_f=gd_f,
              batch=batch, plan=plan, tx=tx, **fns)


def _state(setup, graphdef, params, tx):
  return step_lib.init_train_state(graphdef, jax.tree.map(jnp.copy, params),
                                   tx, setup['mesh'], with_ref=False)


def _dtypes(tree):
  return {str(x.dtype) for x in jax.tree.leaves(tree)}


def _leaves64(tree):
  return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]


# ------------------------------------------------------- mixed precision


def test_bf16_keeps_f32_master_moments_and_gradient_sums(setup):
  """Model stored and computed in bf16; the state holds f32 master weights
  and f32 Adam moments; M bf16 micro-steps sum, through the scan carry and
  the engine's slot-gradient buffers and returns, exactly like a float64 sum
  of the M micro-step gradients, and stay within bf16 compute error of the
  same step computed in f32."""
  tx = setup['tx']
  assert _dtypes(setup['params_b']) == {'bfloat16'}
  state = _state(setup, setup['gd_b'], setup['params_b'], tx)
  assert _dtypes(state.params) == {'float32'}
  moments = [x for x in jax.tree.leaves(state.opt_state)
             if jnp.issubdtype(x.dtype, jnp.floating)]
  assert moments and _dtypes(moments) == {'float32'}

  batch, plan = setup['batch'], setup['plan']
  state_f = _state(setup, setup['gd_f'], state.params, tx)  # Same weights.
  logps = setup['recompute'](state_f, batch, None)
  g_acc, m = setup['grads'](state, batch, logps, plan)
  assert int(m['transfer_id_errors']) == 0 and int(m['dropped']) == 0
  assert _dtypes(g_acc) == {'float32'}

  # Micro-step m alone: zero the loss mask of every other micro-batch (their
  # gradient is then exactly 0, the same program computes step m).
  per_step = []
  for mb in np.asarray(batch['microbatches_Mb']):
    keep = np.zeros(lib.NUM_SAMPLES, np.float32)
    keep[mb] = 1.0
    only = dict(batch, loss_mask_BT=batch['loss_mask_BT'] * keep[:, None])
    per_step.append(_leaves64(setup['grads'](state, only, logps, plan)[0]))
  bf16_carry_err, scale = 0.0, lib.tree_max_abs(g_acc)
  for got, parts in zip(_leaves64(g_acc), zip(*per_step)):
    exact = np.sum(parts, axis=0)
    # A float32 sum of M terms (plus the replicas' returns home, fewer than
    # M more adds) errs by at most 2M * u32 * sum |terms| per element.
    bound = 2 * M * F32_UNIT * np.sum(np.abs(parts), axis=0)
    assert np.all(np.abs(got - exact) <= bound + 1e-30)
    # What a bf16 carry would give: ~2^-9 relative per add, far above it.
    acc = np.zeros_like(exact, dtype=ml_dtypes.bfloat16)
    for p in parts:
      acc = (acc.astype(np.float32) + p.astype(np.float32)).astype(
          ml_dtypes.bfloat16)
    bf16_carry_err = max(bf16_carry_err,
                         float(np.abs(acc.astype(np.float64) - exact).max()))
  assert bf16_carry_err > 100 * 2 * M * F32_UNIT * scale

  # Against the same step computed in f32: what remains is the bf16 compute
  # (a few dozen roundings of up to 2^-9 along forward and backward), 3.2
  # bf16 eps on the whole gradient here. 8 eps bounds it, while one
  # micro-step's gradient lost or counted twice would be ~1 / M = 64 eps.
  g_f32, _ = setup['grads'](state_f, batch, logps, plan)
  a, b = (np.concatenate([x.ravel() for x in _leaves64(t)])
          for t in (g_acc, g_f32))
  assert np.linalg.norm(a - b) <= 8 * BF16_EPS * np.linalg.norm(b)


def _per_sample(x_MbT, microbatches_Mb):
  out = np.zeros((lib.NUM_SAMPLES,) + x_MbT.shape[2:], np.float64)
  out[np.asarray(microbatches_Mb).ravel()] = np.asarray(
      x_MbT, np.float64).reshape((-1,) + x_MbT.shape[2:])
  return out


def _advantages(rewards_B):
  r = np.asarray(rewards_B, np.float64).reshape(-1, lib.NUM_GEN)
  centred = r - r.mean(1, keepdims=True)
  return (centred / (np.sqrt((centred ** 2).mean(1, keepdims=True)) + 1e-6)
          ).reshape(-1)


def test_bf16_rl_run_learns_like_f32(setup):
  """Six GRPO steps on one batch from the same weights, computed in bf16
  (f32 master and moments) and in f32. Both are scored by the same f32
  forward with the surrogate the policy gradient ascends, mean_b A_b *
  (token mean of log p): it rises alike."""
  batch, plan, tx, apply = (setup[k] for k in ('batch', 'plan', 'tx', 'apply'))
  master = step_lib.master_params(setup['params_b'])
  evaluator = _state(setup, setup['gd_f'], master, tx)
  adv = _advantages(batch['rewards_B'])
  mask = np.asarray(batch['loss_mask_BT'], np.float64)

  def score(params):
    logps = setup['recompute'](dataclasses.replace(evaluator, params=params),
                               batch, None)
    lp = _per_sample(logps['old_logp_MbT'], batch['microbatches_Mb'])
    return logps, float(np.mean(adv * (lp * mask).sum(1) / mask.sum(1)))

  curves = {}
  for name in ('bf16', 'f32'):
    state = _state(setup, setup[f'gd_{name[0]}'], master, tx)
    curve = []
    for _ in range(6):
      logps, j = score(state.params)
      curve.append(j)
      grads, m = setup['grads'](state, batch, logps, plan)
      assert int(m['transfer_id_errors']) == 0
      params, opt_state = apply(state.params, state.opt_state, grads)
      state = dataclasses.replace(state, params=params, opt_state=opt_state)
    curves[name] = np.array(curve + [score(state.params)[1]])
  gain_b, gain_f = (c - c[0] for c in (curves['bf16'], curves['f32']))
  assert gain_f[-1] > 1.0, curves  # It learns ...
  # ... and bf16 follows f32 step by step (measured: within 0.1%).
  np.testing.assert_allclose(gain_b[1:], gain_f[1:], rtol=2e-2)
