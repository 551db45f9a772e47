"""Numerics of the update: bf16 training with float32 master weights and
float32 gradient sums, and GRPO's mu (several optimizer updates per rollout)
with the PPO clip checked against a numpy GRPO loss.

One module so the float32 update compiles once for both (compiles dominate).
"""
import dataclasses
import functools

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
      recompute=jax.jit(functools.partial(step_lib.recompute_logps, old=True,
                                          ref=False)),
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
  for i in range(M):
    keep = (np.arange(M) == i).astype(np.float32)[:, None, None]
    only = dict(batch, loss_mask_MbT=batch['loss_mask_MbT'] * keep)
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


def test_canonical_layout_update_equals_the_slot_path(setup):
  """Static EP on the canonical layout (experts differentiated at home: no
  slots, fill or returns) gives the slot path's step: the home placement
  in slots to float32 rounding, and the moving plan (replicas, moves,
  returns) to f32 sums in another order. In bf16 its M micro-step
  gradients are summed in float32 (a float64 sum of them bounds it, as
  for the slots), not in the experts' compute dtype."""
  tx, batch = setup['tx'], setup['batch']
  canon = step_lib.CanonicalLayout()
  state_b = _state(setup, setup['gd_b'], setup['params_b'], tx)
  state_f = _state(setup, setup['gd_f'], state_b.params, tx)
  logps = setup['recompute'](state_f, batch, None)
  home = lib.home_plan(M)
  for state in (state_f, state_b):
    g_c, m_c = setup['grads'](state, batch, logps, canon)
    assert _dtypes(g_c) == {'float32'}
    assert int(m_c['transfer_id_errors']) == 0 and int(m_c['dropped']) == 0
    g_h, m_h = setup['grads'](state, batch, logps, home)
    np.testing.assert_array_equal(m_c['max_rows_M'], m_h['max_rows_M'])
    scale = lib.tree_max_abs(g_h)
    assert scale > 1e-4
    # Same products, same sums: only XLA's fusion choices may round apart.
    tol = (2 * M * F32_UNIT if state is state_f else BF16_EPS) * scale
    for a, b in zip(jax.tree.leaves(g_c), jax.tree.leaves(g_h)):
      assert float(jnp.abs(a - b).max()) <= tol
  g_c, m_c = setup['grads'](state_f, batch, logps, canon)
  g_m, m_m = setup['grads'](state_f, batch, logps, setup['plan'])
  np.testing.assert_allclose(m_c['loss'], m_m['loss'], rtol=1e-5,
                             atol=1e-6 * float(m_m['adv_abs_mean']))
  scale = lib.tree_max_abs(g_m)
  for a, b in zip(jax.tree.leaves(g_c), jax.tree.leaves(g_m)):
    assert float(jnp.abs(a - b).max()) <= 1e-5 * scale
  # bf16 compute, float32 sums over the micro-steps (see the slot test).
  g_acc, _ = setup['grads'](state_b, batch, logps, canon)
  per_step = []
  for i in range(M):
    keep = (np.arange(M) == i).astype(np.float32)[:, None, None]
    only = dict(batch, loss_mask_MbT=batch['loss_mask_MbT'] * keep)
    per_step.append(_leaves64(setup['grads'](state_b, only, logps, canon)[0]))
  for got, parts in zip(_leaves64(g_acc), zip(*per_step)):
    exact = np.sum(parts, axis=0)
    bound = 2 * M * F32_UNIT * np.sum(np.abs(parts), axis=0)
    assert np.all(np.abs(got - exact) <= bound + 1e-30)
  with pytest.raises(ValueError, match='canonical layout'):
    setup['grads'](state_f, batch, dict(logps, prefill_slots=()), canon)


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
  mask = np.asarray(lib.per_sample(batch, 'loss_mask_MbT'), np.float64)

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


# ------------------------------------------------- GRPO update epochs (mu)


def _numpy_grpo(logp_BT, old_BT, rewards_B, mask_BT, eps_low, eps_high):
  """Independent GRPO: loss and d loss / d logp, clipped and unclipped."""
  adv = _advantages(rewards_B)[:, None]
  w = mask_BT / np.maximum(mask_BT.sum(1, keepdims=True), 1) / len(adv)
  ratio = np.where(mask_BT > 0, np.exp(logp_BT - old_BT), 1.0)
  clipped = np.clip(ratio, 1 - eps_low, 1 + eps_high)
  cut = ((ratio > 1 + eps_high) & (adv > 0)) | ((ratio < 1 - eps_low) & (adv < 0))
  loss = np.sum(-np.minimum(ratio * adv, clipped * adv) * w)
  grad_unclipped = -adv * ratio * w
  return dict(loss=loss, loss_unclipped=np.sum(-ratio * adv * w),
              grad=np.where(cut, 0.0, grad_unclipped),
              grad_unclipped=grad_unclipped,
              # Shares of the loss tokens.
              clip_frac=np.sum(cut * mask_BT) / mask_BT.sum(),
              ratio_mean=np.sum(ratio * mask_BT) / mask_BT.sum())


def test_second_epoch_ratio_leaves_one_and_clip_acts(setup):
  """mu = 2 is two updates against the recompute's old log-probs; in the
  second the ratio is no longer 1, the clip cuts tokens, and the gradient is
  the clipped one of a numpy GRPO loss, not the unclipped one."""
  batch, plan, gd = setup['batch'], setup['plan'], setup['gd_f']
  eps_low, eps_high = lib.LOSS_KW['eps_low'], lib.LOSS_KW['eps_high']
  tx = setup['tx']
  state0 = _state(setup, gd, step_lib.master_params(setup['params_b']), tx)
  logps0 = setup['recompute'](state0, batch, None)

  def apply(state, grads):
    params, opt_state = setup['apply'](state.params, state.opt_state, grads)
    return dataclasses.replace(state, params=params, opt_state=opt_state)

  # By hand: two single updates (update_grads + one AdamW step), both
  # against logps0.
  g1, m1 = setup['grads'](state0, batch, logps0, plan)
  state1 = apply(state0, g1)
  g2, m2 = setup['grads'](state1, batch, logps0, plan)
  state2 = apply(state1, g2)

  rl_step = step_lib.make_rl_step(tx, num_update_epochs=2, **lib.LOSS_KW)
  got, m = rl_step.update(_state(setup, gd, state0.params, tx), batch, logps0,
                          plan)
  assert int(got.step) == 1  # One RL step, two optimizer updates.
  for a, b in zip(_leaves64(got.params), _leaves64(state2.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  for k in ('loss', 'ratio_mean', 'clip_frac'):
    np.testing.assert_allclose(m[f'{k}_U'], [m1[k], m2[k]], rtol=1e-5,
                               atol=1e-7)
  np.testing.assert_allclose(m['clip_frac'], (m1['clip_frac'] + m2['clip_frac'])
                             / 2, rtol=1e-5, atol=1e-7)
  # Epoch 1 runs at the old policy: ratio 1, nothing clipped.
  assert abs(float(m1['ratio_mean']) - 1.0) < 1e-5
  assert float(m1['clip_frac']) == 0.0
  assert abs(float(m2['ratio_mean']) - 1.0) > 1e-2
  assert float(m2['clip_frac']) > 0.05

  # The numpy GRPO loss on epoch 2's log-probs (canonical layout, replayed
  # routes) and its clipped and unclipped gradients pulled back to the
  # parameters through the model's VJP.
  full = {k: jnp.asarray(lib.per_sample(batch, k))
          for k in ('tokens_MbT', 'valid_MbT', 'routes_MLbTK')}

  @jax.jit
  def pullback(params, cotangent_BT):
    logp, vjp = jax.vjp(lambda p: step_lib.token_logp(
        gd, p, full['tokens_MbT'], full['valid_MbT'], None,
        full['routes_MLbTK'], None)[0], params)
    return logp, vjp(cotangent_BT)[0]

  mask = np.asarray(lib.per_sample(batch, 'loss_mask_MbT'), np.float64)
  old = _per_sample(logps0['old_logp_MbT'], batch['microbatches_Mb'])
  logp1 = np.asarray(pullback(state1.params, jnp.zeros(mask.shape))[0],
                     np.float64)
  ref = _numpy_grpo(logp1, old, np.asarray(batch['rewards_B']), mask,
                    eps_low, eps_high)
  np.testing.assert_allclose(m2['pg_loss'], ref['loss'], rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(m2['clip_frac'], ref['clip_frac'], atol=1e-6)
  np.testing.assert_allclose(m2['ratio_mean'], ref['ratio_mean'], rtol=1e-5)
  assert abs(ref['loss'] - ref['loss_unclipped']) > 1e-3 * abs(ref['loss'])
  want, unclipped = (pullback(state1.params, jnp.asarray(
      ref[k], jnp.float32))[1] for k in ('grad', 'grad_unclipped'))
  got_g, want, unclipped = (np.concatenate([x.ravel() for x in _leaves64(t)])
                            for t in (g2, want, unclipped))
  np.testing.assert_allclose(got_g, want, atol=1e-5 * np.abs(want).max())
  assert np.linalg.norm(got_g - unclipped) > 0.05 * np.linalg.norm(got_g)
