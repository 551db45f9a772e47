"""GRPO math: hand-computed numbers, a numpy loop reference, edge cases, and
the micro-batch sum property that gradient accumulation relies on."""
import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from foremoe_jax.rl.grpo import group_advantages, policy_loss

EPS_LOW, EPS_HIGH = 0.2, 0.28


def test_group_advantages_hand_numbers():
  rewards = jnp.array([1., 0., 0., 1., .5, .5, .5, .5, 0., 1., 2., 2.])
  adv = group_advantages(rewards, num_generations=4)
  # Group 1: mean .5, std .5. Group 2: all equal -> exactly 0.
  # Group 3: mean 1.25, centred (-1.25, -.25, .75, .75), std sqrt(.6875).
  s3 = math.sqrt(0.6875)
  expected = [1, -1, -1, 1, 0, 0, 0, 0,
              -1.25 / s3, -.25 / s3, .75 / s3, .75 / s3]
  chex.assert_trees_all_close(adv, jnp.array(expected, jnp.float32),
                              atol=1e-5)
  assert (adv[4:8] == 0).all()


def test_group_advantages_eps_and_errors():
  adv = group_advantages(jnp.array([0., 2.]), 2, eps=1.0)
  chex.assert_trees_all_close(adv, jnp.array([-.5, .5]))  # (∓1)/(1 + 1)
  with pytest.raises(ValueError, match='groups of 3'):
    group_advantages(jnp.zeros(8), 3)


def _hand_example():
  """B=2, T=3; see test_policy_loss_hand_numbers for the numbers."""
  logp = np.array([[-1., -2., -np.inf], [-1., -2., -3.]], np.float32)
  ratio = np.array([[1.5, 0.9, 1.], [0.5, 1.0, 1.3]])
  ref_minus_logp = np.array([[0., np.log(2.), 0.], [np.log(.5), 0., 0.]])
  old = (logp - np.log(ratio)).astype(np.float32)
  old[0, 2] = np.nan  # Masked: must not leak.
  ref = (logp + ref_minus_logp).astype(np.float32)
  adv = np.array([1., -2.], np.float32)
  mask = np.array([[1, 1, 0], [1, 1, 1]], np.float32)
  return logp, old, ref, adv, mask


def test_policy_loss_hand_numbers():
  logp, old, ref, adv, mask = _hand_example()
  loss, m = policy_loss(jnp.asarray(logp), old, ref, adv, mask,
                        eps_low=EPS_LOW, eps_high=EPS_HIGH, beta=0.1)
  # seq 0, A=+1: ratio 1.5 -> clipped to 1.28 (counted), ratio .9 -> -.9.
  #   pg = (-1.28 - .9) / 2 = -1.09; kl = (0 + (2 - ln2 - 1)) / 2.
  # seq 1, A=-2: ratio .5 -> min(-1, -1.6) = -1.6 (clipped), 1 -> -2,
  #   1.3 -> min(-2.6, -2.56) = -2.6 (not clipped: A < 0).
  #   pg = (1.6 + 2 + 2.6) / 3; kl = ((.5 + ln2 - 1) + 0 + 0) / 3.
  pg = (-1.09 + 6.2 / 3) / 2
  kl = ((1 - math.log(2)) / 2 + (math.log(2) - .5) / 3) / 2
  assert float(m['pg_loss']) == pytest.approx(pg, abs=1e-5)
  assert float(m['kl']) == pytest.approx(kl, abs=1e-6)
  assert float(loss) == pytest.approx(pg + 0.1 * kl, abs=1e-5)
  assert float(m['loss']) == pytest.approx(float(loss))
  # Shares of the 5 loss tokens: ratios 1.5, .9, .5, 1, 1.3; two clipped.
  assert float(m['ratio_mean']) == pytest.approx(5.2 / 5, abs=1e-5)
  assert float(m['clip_frac']) == pytest.approx(2 / 5, abs=1e-6)


@pytest.mark.parametrize('mode', ['token-mean', 'seq-mean-token-mean',
                                  'seq-mean-token-sum',
                                  'seq-mean-token-sum-norm'])
def test_ratio_and_clip_metrics_are_token_shares_in_every_mode(mode):
  """The loss's weights differ by mode; the ratio and clip statistics are
  the same token shares (verl's masked means): in the token-sum modes the
  loss's weights gave counts per sequence (11.5 'clipped share' here)."""
  logp, old, ref, adv, mask = _hand_example()
  _, m = policy_loss(jnp.asarray(logp), old, ref, adv, mask,
                     eps_low=EPS_LOW, eps_high=EPS_HIGH, beta=0.1,
                     loss_agg_mode=mode, loss_scale_factor=7.0,
                     clip_ratio_c=1.5)
  assert float(m['ratio_mean']) == pytest.approx(5.2 / 5, abs=1e-5)
  assert float(m['clip_frac']) == pytest.approx(2 / 5, abs=1e-6)
  # Dual-clip at c = 1.5 (A = -2, cap 3): seq 1's tokens give pg 1.6, 2,
  # 2.6 - none past the cap; at c = 1.1 (cap 2.2) the 2.6 token is capped.
  assert float(m['dual_clip_frac']) == 0.0
  _, m = policy_loss(jnp.asarray(logp), old, ref, adv, mask,
                     eps_low=EPS_LOW, eps_high=EPS_HIGH, beta=0.1,
                     loss_agg_mode=mode, loss_scale_factor=7.0,
                     clip_ratio_c=1.1)
  assert float(m['dual_clip_frac']) == pytest.approx(1 / 5, abs=1e-6)


def test_policy_loss_hand_gradient():
  logp, old, ref, adv, mask = _hand_example()
  grad = jax.grad(lambda lp: policy_loss(
      lp, old, ref, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH,
      beta=0.1)[0])(jnp.asarray(logp))
  # d/dlogp: unclipped pg gives -ratio * A, clipped gives 0; k3 gives
  # 1 - exp(ref - logp); each token weighted 1 / (len * B).
  expected = np.array([
      [0. + 0.1 * 0., (-.9 + 0.1 * (1 - 2)) / 4, 0.],
      [(0. + 0.1 * .5) / 6, 2. / 6, 2.6 / 6]], np.float32)
  chex.assert_trees_all_close(grad, jnp.asarray(expected), atol=1e-6)


def _numpy_reference(logp, old, ref, adv, mask, eps_low, eps_high, beta):
  """Token-by-token loop, independent of the jnp vectorisation."""
  seq_losses = []
  for b in range(logp.shape[0]):
    terms = []
    for t in range(logp.shape[1]):
      if not mask[b, t]:
        continue
      r = math.exp(logp[b, t] - old[b, t])
      rc = min(max(r, 1 - eps_low), 1 + eps_high)
      pg = -min(r * adv[b], rc * adv[b])
      d = ref[b, t] - logp[b, t]
      terms.append(pg + beta * (math.exp(d) - d - 1))
    seq_losses.append(sum(terms) / len(terms) if terms else 0.0)
  return sum(seq_losses) / len(seq_losses)


def _random_batch(seed, num_seq=8, num_tok=6):
  rng = np.random.default_rng(seed)
  logp = rng.normal(-2, .5, (num_seq, num_tok)).astype(np.float32)
  old = (logp + rng.normal(0, .3, logp.shape)).astype(np.float32)
  ref = (logp + rng.normal(0, .3, logp.shape)).astype(np.float32)
  adv = rng.normal(0, 1, num_seq).astype(np.float32)
  lengths = rng.integers(1, num_tok + 1, num_seq)
  mask = (np.arange(num_tok) < lengths[:, None]).astype(np.float32)
  return logp, old, ref, adv, mask


@pytest.mark.parametrize('seed, eps_low, eps_high, beta', [
    (0, 0.2, 0.2, 0.0), (1, 0.2, 0.28, 0.04), (2, 0.1, 0.5, 1.0)])
def test_policy_loss_matches_numpy_loop(seed, eps_low, eps_high, beta):
  logp, old, ref, adv, mask = _random_batch(seed)
  loss, _ = policy_loss(logp, old, ref, adv, mask, eps_low=eps_low,
                        eps_high=eps_high, beta=beta)
  expected = _numpy_reference(logp.astype(np.float64), old, ref, adv, mask,
                              eps_low, eps_high, beta)
  assert float(loss) == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_equal_rewards_give_no_policy_gradient():
  logp, old, ref, _, mask = _random_batch(3)
  adv = group_advantages(jnp.full((8,), 0.7), num_generations=4)
  grad = jax.grad(lambda lp: policy_loss(
      lp, old, ref, adv, mask, eps_low=.2, eps_high=.2, beta=0.)[0])(
          jnp.asarray(logp))
  chex.assert_trees_all_equal(grad, jnp.zeros_like(grad))


@pytest.mark.parametrize('value', [0.7, 0.1, 1 / 3, 0.9])
def test_a_group_of_equal_rewards_has_advantage_exactly_zero(value):
  # Rewards a float32 mean does not return exactly (0.7 * 8 / 8 != 0.7):
  # the residue divided by its own std + eps was an advantage of +-0.06.
  rewards = np.array([value] * 8 + [0, 1, 0, 1, 1, 1, 0, .5], np.float32)
  adv = np.asarray(group_advantages(jnp.asarray(rewards), num_generations=8))
  np.testing.assert_array_equal(adv[:8], 0.0)
  r = rewards[8:].astype(np.float64)
  want = (r - r.mean()) / (r.std() + 1e-6)  # ddof 0, the default
  np.testing.assert_allclose(adv[8:], want, rtol=1e-5, atol=1e-6)
  unscaled = group_advantages(jnp.asarray(rewards), num_generations=8,
                              scale_by_std=False)
  np.testing.assert_array_equal(np.asarray(unscaled)[:8], 0.0)


@pytest.mark.parametrize('adv,dual_clip', [(-1.0, 3.0), (1.0, None)])
def test_a_ratio_past_exp_range_has_a_finite_zero_gradient(adv, dual_clip):
  # Token 1's log-ratio is 94: exp overflows to inf. The clip (A > 0) or
  # the dual-clip (A < 0) bounds its loss, so its gradient is 0, not
  # 0 * inf = NaN. By hand (seq-mean-token-mean over 2 tokens): token 0
  # has ratio 1, loss -A, gradient -A / 2; token 1's loss is -A * 1.28
  # (clipped, A > 0) or -A * c (capped, A < 0).
  logp = jnp.array([[-0.5, -1.0]], jnp.float32)
  old = jnp.array([[-0.5, -95.0]], jnp.float32)
  mask = jnp.ones((1, 2), jnp.float32)
  loss, grad = jax.value_and_grad(lambda lp: policy_loss(
      lp, old, None, jnp.array([adv]), mask, eps_low=.2, eps_high=.28,
      beta=0., clip_ratio_c=dual_clip)[0])(logp)
  token1 = -adv * (1.28 if adv > 0 else dual_clip)
  np.testing.assert_allclose(float(loss), (-adv + token1) / 2, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(grad), [[-adv / 2, 0.0]], atol=1e-7)


def test_gspo_with_a_huge_sequence_ratio_has_finite_gradients():
  logp = jnp.array([[-0.5, -1.0], [-0.3, -0.2]], jnp.float32)
  old = jnp.array([[-300.0, -400.0], [-0.3, -0.2]], jnp.float32)
  mask = jnp.ones((2, 2), jnp.float32)
  (loss, metrics), grad = jax.value_and_grad(lambda lp: policy_loss(
      lp, old, None, jnp.array([1.0, 1.0]), mask, eps_low=.2, eps_high=.28,
      beta=0., policy_loss_mode='gspo'), has_aux=True)(logp)
  chex.assert_tree_all_finite((loss, metrics, grad))
  # Sequence 0 is clipped (no gradient); sequence 1 has ratio 1: -A / (2*2)
  # per token.
  np.testing.assert_allclose(np.asarray(grad), [[0, 0], [-.25, -.25]],
                             atol=1e-7)


def test_fully_masked_sequence_is_finite_and_contributes_zero():
  logp, old, ref, adv, mask = _random_batch(4, num_seq=4)
  logp[2], old[2], ref[2], mask[2] = -np.inf, np.nan, -np.inf, 0.
  fn = lambda lp, n=None: policy_loss(lp, old, ref, adv, mask, eps_low=.2,
                                      eps_high=.28, beta=.1,
                                      num_sequences_total=n)
  (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(
      jnp.asarray(logp))
  chex.assert_tree_all_finite((loss, metrics, grad))
  assert (grad[2] == 0).all()
  keep = [0, 1, 3]
  sub, _ = policy_loss(logp[keep], old[keep], ref[keep], adv[keep], mask[keep],
                       eps_low=.2, eps_high=.28, beta=.1)
  # Empty sequence counts in the denominator (4), adds 0 to the numerator.
  assert float(loss) == pytest.approx(float(sub) * 3 / 4, rel=1e-6)


def test_reference_optional_when_beta_zero():
  logp, old, ref, adv, mask = _random_batch(5)
  with_ref, m = policy_loss(logp, old, ref, adv, mask, eps_low=.2,
                            eps_high=.2, beta=0.)
  no_ref, m0 = policy_loss(logp, old, None, adv, mask, eps_low=.2,
                           eps_high=.2, beta=0.)
  assert float(with_ref) == float(no_ref)
  assert float(m0['kl']) == 0. and float(m['kl']) > 0.
  with pytest.raises(ValueError, match='ref_logp'):
    policy_loss(logp, old, None, adv, mask, eps_low=.2, eps_high=.2, beta=.1)


@pytest.mark.parametrize('split', [
    [[0, 1, 2, 3], [4, 5, 6, 7]],
    [[0, 1], [2, 3], [4, 5], [6, 7]],
    [[7, 0, 3], [5], [1, 2, 4, 6]],  # Unequal, permuted.
])
def test_microbatch_values_and_grads_sum_to_full_batch(split):
  logp, old, ref, adv, mask = _random_batch(6)
  kw = dict(eps_low=.2, eps_high=.28, beta=.05)
  # The step's counts, as update_grads passes them: its sequences and its
  # loss tokens (the ratio and clip shares are over the latter).
  num_tokens = float(mask.sum())
  vg = jax.jit(jax.value_and_grad(
      lambda lp, o, r, a, m, n: policy_loss(lp, o, r, a, m,
                                            num_sequences_total=n,
                                            num_tokens_total=num_tokens, **kw),
      has_aux=True))
  (full, full_m), full_g = vg(logp, old, ref, adv, mask, 8)
  total, total_m = 0., jax.tree.map(jnp.zeros_like, full_m)
  total_g = np.zeros_like(logp)
  for idx in split:
    (l, m), g = vg(logp[idx], old[idx], ref[idx], adv[idx], mask[idx], 8)
    total += l
    total_m = jax.tree.map(jnp.add, total_m, m)
    total_g[idx] += np.asarray(g)
  assert float(total) == pytest.approx(float(full), rel=1e-5, abs=1e-6)
  chex.assert_trees_all_close(total_m, full_m, atol=1e-6, rtol=1e-5)
  chex.assert_trees_all_close(total_g, np.asarray(full_g), atol=1e-7)
  # Without the global count, the micro-batch means would not add up.
  (wrong, _), _ = vg(logp[split[0]], old[split[0]], ref[split[0]],
                     adv[split[0]], mask[split[0]], len(split[0]))
  assert float(wrong) == pytest.approx(
      float(vg(logp[split[0]], old[split[0]], ref[split[0]], adv[split[0]],
               mask[split[0]], 8)[0][0]) * 8 / len(split[0]), rel=1e-5)


def test_jit_matches_eager():
  logp, old, ref, adv, mask = _random_batch(7)
  fn = functools.partial(policy_loss, eps_low=.2, eps_high=.28, beta=.1)
  eager = fn(logp, old, ref, adv, mask)
  jitted = jax.jit(fn)(logp, old, ref, adv, mask)
  chex.assert_trees_all_close(eager, jitted, rtol=1e-6)
  chex.assert_trees_all_close(jax.jit(group_advantages, static_argnums=1)(
      jnp.arange(8.), 4), group_advantages(jnp.arange(8.), 4))
