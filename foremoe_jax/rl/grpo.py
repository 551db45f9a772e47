"""GRPO advantages and the clipped policy loss, as pure jnp functions.

Sits in the RL step after the verifier: rewards -> `group_advantages`; then,
inside every update micro-step, `policy_loss` turns the current log-probs
(computed with replayed routes) and the recomputed old/ref log-probs into the
loss whose gradient is accumulated.

Shape letters: B sequences (samples), T completion tokens, G generations per
prompt.

Micro-step accumulation: every value `policy_loss` returns is a sum over
sequences divided by `num_sequences_total`. Pass the whole step's sequence
count there and the values (and gradients) of the micro-batches of any split
SUM to the full-batch ones, so accumulating this loss is a plain sum and does
not depend on how samples are composed into micro-batches (other terms of
the step's loss may: see foresight/composition.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def group_advantages(rewards_B: jax.Array, num_generations: int,
                     eps: float = 1e-6) -> jax.Array:
  """(r - group mean) / (group std + eps), float32 [B].

  Groups are consecutive runs of `num_generations` samples (the G answers to
  one prompt), as in GRPO (Shao et al. 2024, DeepSeekMath, Sec. 4.1.2). The
  std is the population one (ddof = 0). A group whose rewards are all equal
  gets advantage exactly 0: it carries no signal about which answer is better.
  """
  rewards_B = jnp.asarray(rewards_B, jnp.float32)
  num = rewards_B.shape[0]
  if num % num_generations:
    raise ValueError(f'{num} rewards do not split into groups of '
                     f'{num_generations}.')
  r_NG = rewards_B.reshape(num // num_generations, num_generations)
  centred_NG = r_NG - r_NG.mean(axis=1, keepdims=True)
  std_N1 = jnp.sqrt(jnp.mean(jnp.square(centred_NG), axis=1, keepdims=True))
  return (centred_NG / (std_N1 + eps)).reshape(num)


def policy_loss(logp_BT: jax.Array, old_logp_BT: jax.Array,
                ref_logp_BT: jax.Array | None, adv_B: jax.Array,
                mask_BT: jax.Array, *, eps_low: float, eps_high: float,
                beta: float, num_sequences_total: int | jax.Array | None = None
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Clipped-ratio GRPO loss with a k3 KL penalty; returns (loss, metrics).

  Per token, with ratio = exp(logp - old_logp):
    pg = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
    kl = exp(ref - logp) - (ref - logp) - 1     (k3 estimator, >= 0)
    loss_token = pg + beta * kl
  The asymmetric clip range is DAPO's "clip-higher" (Yu et al. 2025, Sec. 3.1).

  What the clip does depends on GRPO's mu (`rl.num_update_epochs`, the
  optimizer updates per rollout). With mu = 1 the only update runs at the
  policy that produced old_logp, so ratio = 1 at every token (up to the
  rounding between recompute and update, far inside the range): 1 lies inside
  [1 - eps_low, 1 + eps_high], the clipped and unclipped terms coincide in
  value and in gradient (-A * grad logp), and eps_low / eps_high change
  nothing (clip_frac is 0). With mu > 1 the later updates see ratio != 1 and
  the clip removes the gradient of tokens that moved past the range in the
  direction their advantage pushes.
  Aggregation: token mean within each sequence over `mask_BT`, then the sum
  over sequences divided by `num_sequences_total` (default B, the plain mean).
  A fully masked sequence contributes 0, still counts in the denominator, and
  never yields NaN, even if its log-probs are -inf.

  ref_logp_BT may be None when beta == 0; the KL terms are then 0.
  old_logp_BT and ref_logp_BT are constants (no gradient flows into them).

  Metrics, aggregated exactly like the loss (so they also sum over
  micro-batches): pg_loss, kl, ratio_mean, clip_frac (share of tokens whose
  gradient the clip removes: ratio < 1 - eps_low with A < 0, or
  ratio > 1 + eps_high with A > 0), and loss.
  """
  if ref_logp_BT is None and beta != 0:
    raise ValueError('beta != 0 needs ref_logp_BT.')
  mask_BT = jnp.asarray(mask_BT, jnp.float32)
  valid_BT = mask_BT > 0
  # Zero the log-probs of masked tokens *before* exp: -inf or garbage there
  # would make inf * 0 = NaN in the value, and NaN in the gradient too.
  logp_BT = jnp.where(valid_BT, logp_BT.astype(jnp.float32), 0.0)
  old_logp_BT = jnp.where(valid_BT, jax.lax.stop_gradient(
      old_logp_BT.astype(jnp.float32)), 0.0)
  adv_B1 = jax.lax.stop_gradient(jnp.asarray(adv_B, jnp.float32))[:, None]

  ratio_BT = jnp.exp(logp_BT - old_logp_BT)
  clipped_BT = jnp.clip(ratio_BT, 1.0 - eps_low, 1.0 + eps_high)
  pg_BT = -jnp.minimum(ratio_BT * adv_B1, clipped_BT * adv_B1)
  is_clipped_BT = (((ratio_BT < 1.0 - eps_low) & (adv_B1 < 0))
                   | ((ratio_BT > 1.0 + eps_high) & (adv_B1 > 0)))

  if ref_logp_BT is None:
    kl_BT = jnp.zeros_like(logp_BT)
  else:
    ref_logp_BT = jnp.where(valid_BT, jax.lax.stop_gradient(
        ref_logp_BT.astype(jnp.float32)), 0.0)
    log_ratio_BT = ref_logp_BT - logp_BT
    kl_BT = jnp.exp(log_ratio_BT) - log_ratio_BT - 1.0

  if num_sequences_total is None:
    num_sequences_total = logp_BT.shape[0]
  # max(count, 1): an empty sequence has numerator 0, so it contributes 0.
  inv_len_B = 1.0 / jnp.maximum(mask_BT.sum(axis=1), 1.0)

  def aggregate(x_BT):
    per_seq_B = jnp.sum(x_BT * mask_BT, axis=1) * inv_len_B
    return jnp.sum(per_seq_B) / num_sequences_total

  pg_loss = aggregate(pg_BT)
  kl = aggregate(kl_BT)
  loss = pg_loss + beta * kl
  metrics = {'loss': loss, 'pg_loss': pg_loss, 'kl': kl,
             'ratio_mean': aggregate(ratio_BT),
             'clip_frac': aggregate(is_clipped_BT.astype(jnp.float32))}
  return loss, jax.tree.map(jax.lax.stop_gradient, metrics)
