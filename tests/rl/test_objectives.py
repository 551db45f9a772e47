"""The objective's options (rl/grpo.py) against an independent numpy loop:
loss_agg_mode, dual-clip, KL estimators, GSPO, and the advantages' ddof and
std scaling; micro-batch sums equal the whole batch in every mode; the
config rules; and one non-default mode through the real update_grads.

The reference below walks the batch token by token in float64 and derives
every gradient by hand (checked against finite differences of its own
loss), so it shares no code and no vectorisation with rl/grpo.py.
"""
import importlib
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

import rl_testlib as lib
from foremoe_jax import config as config_lib
from foremoe_jax.model import expert_parallel as ep
from foremoe_jax.model import transformer
from foremoe_jax.rl import grpo
from foremoe_jax.rl import step as step_lib

EPS_LOW, EPS_HIGH = 0.2, 0.28
BETA = 0.1


def _kl_and_grad(logp, ref, kind):
  """One token's KL estimate and its derivative in logp."""
  d = ref - logp
  if kind in ('k1', 'kl'):
    return logp - ref, 1.0
  if kind == 'abs':
    return abs(logp - ref), math.copysign(1.0, logp - ref)
  if kind in ('k2', 'mse'):
    return 0.5 * (logp - ref) ** 2, logp - ref
  # k3 with verl's clamps: a clamped token is a constant.
  dc = min(max(d, -20.0), 20.0)
  v = math.exp(dc) - dc - 1.0
  if v > 10.0:
    return 10.0, 0.0
  return v, (0.0 if dc != d else 1.0 - math.exp(d))


def numpy_objective(logp, old, ref, adv, mask, *, mode, kl='k3',
                    policy='ppo', clip_c=None, scale=None, n_seq=None,
                    n_tok=None, eps=(EPS_LOW, EPS_HIGH), beta=BETA):
  """(loss, metrics, d loss / d logp) by loops over tokens, float64."""
  num_seq, num_tok = logp.shape
  lengths = [int(sum(mask[b])) for b in range(num_seq)]
  if n_seq is None:
    n_seq = num_seq  # Fully masked sequences count too.
  if n_tok is None:
    n_tok = sum(lengths)
  if scale is None:
    scale = num_tok
  lo, hi = 1 - eps[0], 1 + eps[1]
  out = dict(loss=0., pg_loss=0., kl=0., ratio_mean=0., clip_frac=0.,
             dual_clip_frac=0.)
  grad = np.zeros(logp.shape)
  for b in range(num_seq):
    n, a = lengths[b], float(adv[b])
    if n == 0:
      continue  # Weight 0 (still counted in n_seq).
    toks = [t for t in range(num_tok) if mask[b][t]]
    s_seq = math.exp(sum(logp[b][t] - old[b][t] for t in toks) / n)
    for t in toks:
      w = {'token-mean': 1 / n_tok, 'seq-mean-token-mean': 1 / (n * n_seq),
           'seq-mean-token-sum': 1 / n_seq,
           'seq-mean-token-sum-norm': 1 / (scale * n_seq)}[mode]
      r = s_seq if policy == 'gspo' else math.exp(logp[b][t] - old[b][t])
      cut = (r < lo and a < 0) or (r > hi and a > 0)
      pg = -a * min(max(r, lo), hi) if cut else -a * r
      dpg_dr = 0.0 if cut else -a
      dual = bool(clip_c) and a < 0 and pg > -a * clip_c
      if dual:
        pg, dpg_dr = -a * clip_c, 0.0
      kl_v, kl_g = _kl_and_grad(logp[b][t], ref[b][t], kl)
      for k, v in (('pg_loss', pg), ('kl', kl_v), ('loss', pg + beta * kl_v)):
        out[k] += w * v
      # Shares: of the step's tokens, or with gspo of its sequences.
      share = 1 / (n * n_seq) if policy == 'gspo' else 1 / n_tok
      for k, v in (('ratio_mean', r), ('clip_frac', cut),
                   ('dual_clip_frac', dual)):
        out[k] += share * v
      grad[b][t] += w * beta * kl_g
      if policy == 'gspo':  # ds / d logp_u = s / n for every token u.
        for u in toks:
          grad[b][u] += w * dpg_dr * s_seq / n
      else:
        grad[b][t] += w * dpg_dr * r
  return out, grad


def _batch(seed=0, num_seq=9, num_tok=7):
  """Uneven masks with holes, one fully masked and one full sequence; log
  ratios far outside the clip range; references far enough for k3's value
  clamp, and two tokens for the log-ratio clamp."""
  rng = np.random.default_rng(seed)
  logp = rng.normal(-2, .5, (num_seq, num_tok))
  old = logp - rng.uniform(-3, 3, logp.shape)
  ref = logp + rng.uniform(-4, 4, logp.shape)
  ref[0, 0], ref[1, 1] = logp[0, 0] + 25., logp[1, 1] - 12.
  mask = (rng.random(logp.shape) < 0.6).astype(np.float64)
  mask[0, :2] = mask[1, :2] = 1.
  mask[2] = 0.  # Fully masked.
  mask[5] = 1.
  adv = rng.normal(0, 1, num_seq)
  adv[3] = 0.
  adv[:2] = (1.3, -0.8)
  f32 = lambda x: np.asarray(x, np.float32)
  # The reference reads the same float32 numbers, in float64.
  return tuple(f32(x).astype(np.float64) for x in (logp, old, ref, adv, mask))


def _jax_objective(batch, **kw):
  """(loss, metrics), d loss / d logp from rl/grpo.py, float64 numpy."""
  logp, old, ref, adv, mask = (jnp.asarray(x, jnp.float32) for x in batch)
  (loss, m), g = jax.value_and_grad(
      lambda lp: grpo.policy_loss(lp, old, ref, adv, mask, eps_low=EPS_LOW,
                                  eps_high=EPS_HIGH, beta=BETA, **kw),
      has_aux=True)(logp)
  return ({k: float(v) for k, v in m.items()},
          np.asarray(g, np.float64))


CASES = [  # (loss_agg_mode, kl_estimator, policy_loss_mode, clip_ratio_c)
    ('token-mean', 'k3', 'ppo', None),
    ('token-mean', 'k1', 'ppo', 3.0),
    ('seq-mean-token-mean', 'low_var_kl', 'ppo', 2.0),
    ('seq-mean-token-sum', 'abs', 'ppo', None),
    ('seq-mean-token-sum-norm', 'mse', 'ppo', 1.5),
    ('seq-mean-token-mean', 'k2', 'gspo', None),
    ('seq-mean-token-mean', 'kl', 'gspo', 1.5),
]


def _kw(mode, kl, policy, clip_c):
  kw = dict(loss_agg_mode=mode, kl_estimator=kl, policy_loss_mode=policy,
            clip_ratio_c=clip_c)
  if policy == 'gspo':  # A range the sequence ratios straddle.
    kw.update(gspo_eps_low=.1, gspo_eps_high=.15)
  if mode == 'seq-mean-token-sum-norm':
    kw['loss_scale_factor'] = 10.
  return kw


def _ref_kw(kw):
  return dict(mode=kw['loss_agg_mode'], kl=kw['kl_estimator'],
              policy=kw['policy_loss_mode'], clip_c=kw['clip_ratio_c'],
              scale=kw.get('loss_scale_factor'),
              eps=((kw['gspo_eps_low'], kw['gspo_eps_high'])
                   if kw['policy_loss_mode'] == 'gspo'
                   else (EPS_LOW, EPS_HIGH)))


@pytest.mark.parametrize('mode, kl, policy, clip_c', CASES)
def test_matches_numpy_loop_value_metrics_and_gradient(mode, kl, policy,
                                                       clip_c):
  batch = _batch()
  kw = _kw(mode, kl, policy, clip_c)
  got, got_g = _jax_objective(batch, **kw)
  want, want_g = numpy_objective(*batch, **_ref_kw(kw))
  # Sums of O(1) terms times weights: float32 rounding of each term.
  scale = max(abs(want['pg_loss']), abs(want['kl']), 1e-3)
  for k in want:
    assert got[k] == pytest.approx(want[k], abs=2e-6 * max(scale, 1.)), k
  np.testing.assert_allclose(got_g, want_g, rtol=1e-4,
                             atol=1e-6 * np.abs(want_g).max())
  assert (got_g[2] == 0).all()  # The fully masked sequence.
  # The cases exercise what they name: the clip cuts, the dual-clip caps.
  assert want['clip_frac'] > 0
  if clip_c:
    assert want['dual_clip_frac'] > 0


@pytest.mark.parametrize('mode, kl, policy, clip_c',
                         [CASES[0], CASES[1], CASES[6]])
def test_numpy_reference_gradient_matches_finite_differences(mode, kl, policy,
                                                             clip_c):
  """The reference's hand-derived gradient is its loss's (token-mean,
  dual-clip, GSPO): central differences in float64."""
  batch = _batch()
  ref_kw = _ref_kw(_kw(mode, kl, policy, clip_c))
  _, grad = numpy_objective(*batch, **ref_kw)
  logp, h = batch[0], 1e-6
  fd = np.zeros_like(grad)
  for b, t in np.ndindex(logp.shape):
    lp = logp.copy()
    lp[b, t] += h
    up = numpy_objective(lp, *batch[1:], **ref_kw)[0]['loss']
    lp[b, t] -= 2 * h
    down = numpy_objective(lp, *batch[1:], **ref_kw)[0]['loss']
    fd[b, t] = (up - down) / (2 * h)
  np.testing.assert_allclose(grad, fd, atol=1e-7)
  assert np.abs(grad).max() > 1e-2


def test_dual_clip_caps_negative_advantage_loss():
  """Hand case: A = -2, ratio e^2 = 7.39 > c = 3: the token's loss is
  -A * c = 6 and its gradient 0; without dual-clip it is 2 * 7.39."""
  logp, old = jnp.array([[0., 0.]]), jnp.array([[-2., 0.]])
  kw = dict(eps_low=.2, eps_high=.2, beta=0., loss_agg_mode='token-mean')
  fn = lambda lp, c: grpo.policy_loss(lp, old, None, jnp.array([-2.]),
                                      jnp.ones((1, 2)), clip_ratio_c=c, **kw)
  (loss, m), g = jax.jit(jax.value_and_grad(fn, has_aux=True),
                         static_argnums=1)(logp, 3.)
  assert float(loss) == pytest.approx((6. + 2.) / 2, rel=1e-6)
  np.testing.assert_allclose(g, [[0., 2. / 2]], rtol=1e-6)
  assert float(m['dual_clip_frac']) == pytest.approx(.5)
  assert float(jax.jit(fn, static_argnums=1)(logp, None)[0]) == pytest.approx(
      (2 * math.exp(2.) + 2.) / 2, rel=1e-6)


def test_gspo_ratio_is_per_sequence_and_one_on_policy():
  """Every token of a sequence sees the geometric-mean ratio; at
  old = logp (mu = 1) the ratio is 1 and GSPO's gradient is GRPO's."""
  logp, old, ref, adv, mask = _batch(1)
  kw = dict(eps_low=.2, eps_high=.28, beta=0.)
  _, m = grpo.policy_loss(logp, old, ref, adv, mask, policy_loss_mode='gspo',
                          **kw)
  s_B = [math.exp(np.sum((logp[b] - old[b]) * mask[b]) / mask[b].sum())
         for b in range(len(adv)) if mask[b].sum()]
  # Mean over all 9 sequences, the fully masked one adding 0.
  assert float(m['ratio_mean']) == pytest.approx(np.sum(s_B) / len(adv),
                                                 rel=1e-5)
  g = {p: jax.grad(lambda lp, p=p: grpo.policy_loss(
      lp, jax.lax.stop_gradient(lp), None, adv, mask, policy_loss_mode=p,
      **kw)[0])(jnp.asarray(logp, jnp.float32)) for p in ('ppo', 'gspo')}
  np.testing.assert_allclose(g['gspo'], g['ppo'], rtol=1e-6, atol=1e-9)


MODES = ('token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum',
         'seq-mean-token-sum-norm')


@pytest.mark.parametrize('mode, policy', [(m, 'ppo') for m in MODES]
                         + [('seq-mean-token-mean', 'gspo')])
def test_microbatch_values_and_grads_sum_to_full_batch(mode, policy):
  """3 permuted micro-batches, uneven in tokens, with the step's counts (a
  fully masked sequence in one of them) sum to the whole batch, values,
  metrics and gradients; the micro-batches' own counts would not."""
  batch = _batch(2)
  kw = _kw(mode, 'k3', policy, 2.0)
  mask = batch[4]
  counts = dict(num_sequences_total=len(mask),
                num_tokens_total=int(mask.sum()))
  full, full_g = _jax_objective(batch, **kw, **counts)
  total, total_g = dict.fromkeys(full, 0.), np.zeros_like(full_g)
  own = 0.
  # Equal sizes: one shape for every micro-batch keeps this test fast.
  for idx in ([4, 0, 7], [2, 8, 1], [3, 5, 6]):
    part = tuple(x[idx] for x in batch)
    m, g = _jax_objective(part, **kw, **counts)
    total = {k: total[k] + m[k] for k in total}
    total_g[idx] += g
    own += _jax_objective(part, **kw)[0]['loss']
  for k in full:
    assert total[k] == pytest.approx(full[k], rel=1e-5, abs=1e-6), k
  np.testing.assert_allclose(total_g, full_g, rtol=1e-5,
                             atol=1e-7 * np.abs(full_g).max())
  assert abs(own - full['loss']) > 1e-3 * abs(full['loss'])


def test_token_mean_without_step_token_count_is_refused():
  """A caller passing the step's sequence count is accumulating: a
  'token-mean' loss without the step's token count could not sum."""
  logp, old, ref, adv, mask = _batch()
  with pytest.raises(ValueError, match='num_tokens_total'):
    grpo.policy_loss(logp, old, ref, adv, mask, eps_low=.2, eps_high=.2,
                     beta=.1, loss_agg_mode='token-mean',
                     num_sequences_total=8)


@pytest.mark.parametrize('kw, match', [
    (dict(policy_loss_mode='gspo', loss_agg_mode='token-mean'),
     'seq-mean-token-mean'),
    (dict(loss_agg_mode='token-sum'), 'loss_agg_mode'),
    (dict(kl_estimator='k4'), 'kl_estimator'),
    (dict(policy_loss_mode='vanilla'), 'policy_loss_mode'),
    (dict(clip_ratio_c=0.5), 'clip_ratio_c'),
])
def test_invalid_objectives_fail_when_the_step_is_built(kw, match):
  with pytest.raises(ValueError, match=match):
    step_lib.make_rl_step(step_lib.make_optimizer(1e-3, 1.), num_generations=4,
                          eps_low=.2, eps_high=.2, beta=0., **kw)


@pytest.mark.parametrize('ddof, by_std', [(0, True), (1, True), (0, False),
                                          (1, False)])
def test_group_advantages_ddof_and_std_scaling(ddof, by_std):
  rng = np.random.default_rng(3)
  rewards = rng.integers(0, 3, 12).astype(np.float64)
  rewards[4:8] = 1.  # A group with one reward: advantage 0.
  adv = grpo.group_advantages(rewards, 4, ddof=ddof, scale_by_std=by_std)
  want = []
  for g in range(3):
    r = rewards[4 * g: 4 * g + 4]
    c = r - r.mean()
    want += list(c / (np.std(r, ddof=ddof) + 1e-6) if by_std else c)
  np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-6)
  assert (np.asarray(adv)[4:8] == 0).all()
  # Unbiased std at G = 4 scales each advantage by sqrt(3 / 4).
  if by_std and ddof == 1:
    np.testing.assert_allclose(adv, grpo.group_advantages(rewards, 4)
                               * math.sqrt(3 / 4), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('field, value', [
    ('loss_agg_mode', 'token_mean'), ('loss_scale_factor', -1.),
    ('clip_ratio_c', 1.0), ('kl_estimator', 'full'), ('adv_std_ddof', 2),
    ('norm_adv_by_std', 'no'), ('policy_loss', 'vanilla'),
    ('gspo_eps_low', 1.5), ('gspo_eps_high', -1.)])
def test_config_rejects_each_bad_objective_field(field, value):
  cfg = _tiny_config()
  del cfg.rl[field]  # A value of another type: ConfigDict would refuse it.
  cfg.rl[field] = value
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate_config(cfg)
  msg = str(e.value)
  assert '\n' not in msg
  assert msg.startswith('rl.gspo_eps_low' if field.startswith('gspo')
                        else f'rl.{field}:'), msg


def test_config_defaults_and_gspo_rule():
  cfg = _tiny_config()
  config_lib.validate_config(cfg)
  # tiny.py spells every default out; a config without them gets the same.
  assert config_lib.rl_objective(cfg.rl) == config_lib.rl_objective({})
  cfg.rl.policy_loss, cfg.rl.loss_agg_mode = 'gspo', 'token-mean'
  with pytest.raises(config_lib.ConfigError, match='rl.loss_agg_mode:'):
    config_lib.validate_config(cfg)
  opts = step_lib.objective_options(_tiny_config().rl, completion_len=12)
  assert opts['loss_scale_factor'] == 12. and opts['clip_ratio_c'] is None
  assert set(opts) == set(step_lib.OBJECTIVE_OPTIONS)


def _tiny_config():
  return importlib.import_module('configs.tiny').get_config()


def test_update_grads_passes_every_option_and_step_counts(monkeypatch):
  """make_rl_step -> update_grads hands every objective option to the loss
  and the advantages, with the step's counts (traced only: compiling the
  update costs ~13 s, the value checks are the numpy tests above)."""
  cfg, mesh = lib.mini_config('float32'), ep.make_mesh(1, lib.NUM_EP)
  gd, params = nnx.split(nnx.eval_shape(lambda: transformer.Transformer(
      cfg.model, mesh, rngs=nnx.Rngs(0))))
  state = step_lib.TrainState(gd, params, None, None,
                              jax.ShapeDtypeStruct((), jnp.int32))
  batch = lib.synthetic_batch(2)
  opts = step_lib.objective_options(ml_collections.ConfigDict(dict(
      loss_agg_mode='token-mean', clip_ratio_c=2.5, kl_estimator='mse',
      adv_std_ddof=1, norm_adv_by_std=False, loss_scale_factor=7.,
      gspo_eps_low=.1, gspo_eps_high=.2)), completion_len=5)
  seen = {}
  for name in ('policy_loss', 'group_advantages'):
    def spy(*a, _name=name, _fn=getattr(grpo, name), **k):
      seen[_name] = k
      return _fn(*a, **k)
    monkeypatch.setattr(grpo, name, spy)
  rl_step = step_lib.make_rl_step(None, **dict(lib.LOSS_KW, **opts))
  jax.eval_shape(lambda s, b: step_lib.update_grads(
      s, b, {}, lib.moving_plan(2), **rl_step.loss_kw), state, batch)
  assert seen['group_advantages'] == dict(ddof=1, scale_by_std=False)
  loss_kw = seen['policy_loss']
  assert {k: loss_kw[k] for k in ('loss_agg_mode', 'clip_ratio_c',
                                  'kl_estimator', 'loss_scale_factor',
                                  'gspo_eps_low', 'gspo_eps_high',
                                  'policy_loss_mode')} == dict(
      loss_agg_mode='token-mean', clip_ratio_c=2.5, kl_estimator='mse',
      loss_scale_factor=7., gspo_eps_low=.1, gspo_eps_high=.2,
      policy_loss_mode='ppo')
  # Step-level counts (traced scalars), never a micro-batch's own.
  assert {'num_sequences_total', 'num_tokens_total'} <= set(loss_kw)


def test_the_step_refuses_a_missing_scale_factor_or_reference():
  """Dr.GRPO's constant cannot default to the loss mask's width in the
  step (it spans the prompt's positions too: C / (T - 1) of the loss), and
  beta > 0 without the reference's log-probs would drop the KL silently."""
  with pytest.raises(ValueError, match='needs loss_scale_factor'):
    step_lib.make_rl_step(None, **dict(
        lib.LOSS_KW, loss_agg_mode='seq-mean-token-sum-norm'))
  step_lib.make_rl_step(None, **dict(
      lib.LOSS_KW, loss_agg_mode='seq-mean-token-sum-norm',
      loss_scale_factor=5.0))
  cfg, mesh = lib.mini_config('float32'), ep.make_mesh(1, lib.NUM_EP)
  gd, params = nnx.split(nnx.eval_shape(lambda: transformer.Transformer(
      cfg.model, mesh, rngs=nnx.Rngs(0))))
  state = step_lib.TrainState(gd, params, None, None,
                              jax.ShapeDtypeStruct((), jnp.int32))
  kw = dict(lib.LOSS_KW, beta=0.1)
  with pytest.raises(ValueError, match='reference log-probs'):
    jax.eval_shape(lambda s, b: step_lib.update_grads(
        s, b, {}, lib.moving_plan(2), **kw), state, lib.synthetic_batch(2))
