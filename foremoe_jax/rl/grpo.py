"""GRPO advantages and the clipped policy loss, as pure jnp functions.

Sits in the RL step after the verifier: rewards -> `group_advantages`; then,
inside every update micro-step, `policy_loss` turns the current log-probs
(computed with replayed routes) and the recomputed old/ref log-probs into the
loss whose gradient is accumulated.

Shape letters: B sequences (samples), T completion tokens, G generations per
prompt.

The objective's options carry verl's names (WORKSPACE.md "RL objectives:
verl and TRL names" maps them to verl's and TRL's settings and says where
the defaults differ): `loss_agg_mode`, `clip_ratio_c` (dual-clip),
`kl_estimator`, `policy_loss_mode` ('ppo' or 'gspo'), and, for the
advantages, `ddof` and `scale_by_std`.

Micro-step accumulation: every value `policy_loss` returns is a sum over
tokens, each weighted by a step-level constant (`loss_weights`): the step's
count of sequences (`num_sequences_total`), or its count of loss tokens
(`num_tokens_total`, for 'token-mean'). Pass the whole step's counts there
(over every micro-batch and every device) and the values (and gradients) of
the micro-batches of any split SUM to the full-batch ones, so accumulating
this loss is a plain sum and does not depend on how samples are composed
into micro-batches, in every mode (other terms of the step's loss may: see
foresight/composition.py). GSPO keeps it too: its ratio is per sequence,
and a sequence never straddles micro-batches.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from foremoe_jax.config import KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES

# verl's clamps for k3 ('low_var_kl'): the log-ratio before exp, and the k3
# value (k3 >= 0, so only the upper bound can bind).
K3_LOG_RATIO_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0
# Bounds on the importance log-ratios before exp (verl's): per token
# (+-20) and per sequence with 'gspo' (at most 10).
MAX_LOG_RATIO = 20.0
MAX_LOG_SEQ_RATIO = 10.0

_KL_CANONICAL = {'k1': 'k1', 'kl': 'k1', 'abs': 'abs', 'k2': 'k2',
                 'mse': 'k2', 'k3': 'k3', 'low_var_kl': 'k3'}


def group_advantages(rewards_B: jax.Array, num_generations: int,
                     eps: float = 1e-6, *, ddof: int = 0,
                     scale_by_std: bool = True) -> jax.Array:
  """(r - group mean) / (group std + eps), float32 [B].

  Groups are consecutive runs of `num_generations` samples (the G answers to
  one prompt), as in GRPO (Shao et al. 2024, DeepSeekMath, Sec. 4.1.2). A
  group whose rewards are all equal gets advantage exactly 0: it carries no
  signal about which answer is better.

  ddof (`rl.adv_std_ddof`): 0 (default) is the population std, so every
  group with distinct rewards has advantages of RMS exactly 1 whatever G,
  and the balance between the policy term and beta * KL (and what the
  gradient clip sees) does not move when num_generations changes; 1 is the
  unbiased std that verl and TRL use (torch.std), which scales every
  advantage by sqrt((G - 1) / G): 0.935 at G = 8, 0.707 at G = 2.
  scale_by_std (`rl.norm_adv_by_std`): False returns r - group mean, as
  Dr.GRPO (arXiv:2503.20783) and verl's norm_adv_by_std_in_grpo=False: the
  std divides away how hard the prompt was, which that paper calls a bias.
  """
  rewards_B = jnp.asarray(rewards_B, jnp.float32)
  num = rewards_B.shape[0]
  if num % num_generations:
    raise ValueError(f'{num} rewards do not split into groups of '
                     f'{num_generations}.')
  if ddof not in (0, 1) or ddof >= num_generations:
    raise ValueError(f'ddof must be 0 or 1 and < num_generations '
                     f'({num_generations}), got {ddof!r}.')
  r_NG = rewards_B.reshape(num // num_generations, num_generations)
  # Centred about the group's first reward before the mean: a group of
  # equal rewards is then exactly 0, where r - mean(r) in float32 leaves
  # a rounding residue (1e-8 at 0.7, G = 8) that dividing by its own std
  # (+ eps) blew up to an advantage of +-0.06, one sign for the group.
  shifted_NG = r_NG - r_NG[:, :1]
  centred_NG = shifted_NG - shifted_NG.mean(axis=1, keepdims=True)
  if not scale_by_std:
    return centred_NG.reshape(num)
  std_N1 = jnp.sqrt(jnp.sum(jnp.square(centred_NG), axis=1, keepdims=True)
                    / (num_generations - ddof))
  return (centred_NG / (std_N1 + eps)).reshape(num)


def check_objective(*, loss_agg_mode: str = 'seq-mean-token-mean',
                    kl_estimator: str = 'k3', policy_loss_mode: str = 'ppo',
                    clip_ratio_c: float | None = None,
                    loss_scale_factor: float | None = None) -> None:
  """One-line ValueError for an objective `policy_loss` cannot compute."""
  if loss_agg_mode not in LOSS_AGG_MODES:
    raise ValueError(f"loss_agg_mode must be one of {', '.join(LOSS_AGG_MODES)}"
                     f', got {loss_agg_mode!r}.')
  if kl_estimator not in KL_ESTIMATORS:
    raise ValueError(f"kl_estimator must be one of {', '.join(KL_ESTIMATORS)}"
                     f', got {kl_estimator!r}.')
  if policy_loss_mode not in POLICY_LOSSES:
    raise ValueError(f"policy_loss_mode must be one of "
                     f"{', '.join(POLICY_LOSSES)}, got {policy_loss_mode!r}.")
  if policy_loss_mode == 'gspo' and loss_agg_mode != 'seq-mean-token-mean':
    raise ValueError("policy_loss_mode='gspo' needs loss_agg_mode="
                     "'seq-mean-token-mean' (GSPO's objective is a mean over "
                     f'sequences), got {loss_agg_mode!r}.')
  if clip_ratio_c and not clip_ratio_c > 1:
    raise ValueError(f'clip_ratio_c must be 0/None (off) or > 1, got '
                     f'{clip_ratio_c!r}.')
  if loss_scale_factor is not None and not loss_scale_factor > 0:
    raise ValueError(f'loss_scale_factor must be > 0 (or None: the mask '
                     f'width), got {loss_scale_factor!r}.')


def loss_weights(mask_BT: jax.Array, loss_agg_mode: str, *,
                 num_sequences_total: int | jax.Array | None = None,
                 num_tokens_total: int | jax.Array | None = None,
                 loss_scale_factor: float | None = None) -> jax.Array:
  """Per-token weights w [B, T] such that a loss is sum(x_BT * w), float32.

  loss_agg_mode (verl's names):
    'token-mean'              mask / N_tok: every loss token of the step
                              weighs the same (verl's default; DAPO; TRL
                              'dapo').
    'seq-mean-token-mean'     mask / (len_b * N_seq): each sequence's token
                              mean, then the mean over sequences (GRPO's
                              paper; TRL 'grpo'; our default).
    'seq-mean-token-sum'      mask / N_seq: each sequence's token sum, then
                              the mean over sequences (verl's, no normaliser).
    'seq-mean-token-sum-norm' mask / (loss_scale_factor * N_seq): Dr.GRPO
                              (arXiv:2503.20783; TRL 'dr_grpo'): the token
                              sum over a constant, the maximal completion
                              length; None takes the mask's width T, as
                              verl does.
  N_seq = num_sequences_total counts the sequences and N_tok =
  num_tokens_total the loss tokens, over the whole step (every micro-batch
  and device); None counts them in this batch (B, and mask.sum()). N_tok
  is floored at 1 so an empty batch gives 0, not NaN.

  A fully masked sequence has weight 0 and still counts in N_seq, as in
  TRL (verl leaves it out of the mean): a zero mask then removes a
  sequence's terms without reweighting the others' (tests isolate one
  micro-step that way; a filter of truncated completions would do the
  same), and N_seq is the static step size. Our sampler gives every
  sequence at least one completion token, so the two rules give the same
  numbers in every run.
  """
  mask_BT = jnp.asarray(mask_BT, jnp.float32)
  len_B1 = mask_BT.sum(axis=1, keepdims=True)
  if loss_agg_mode == 'token-mean':
    if num_tokens_total is None:
      num_tokens_total = mask_BT.sum()
    return mask_BT / jnp.maximum(num_tokens_total, 1.0)
  if num_sequences_total is None:
    num_sequences_total = mask_BT.shape[0]
  inv_seq = 1.0 / jnp.asarray(num_sequences_total, jnp.float32)
  if loss_agg_mode == 'seq-mean-token-mean':
    # max(len, 1): an empty sequence's weights are 0 anyway.
    return mask_BT / jnp.maximum(len_B1, 1.0) * inv_seq
  if loss_agg_mode == 'seq-mean-token-sum':
    return mask_BT * inv_seq
  if loss_agg_mode == 'seq-mean-token-sum-norm':
    scale = (mask_BT.shape[1] if loss_scale_factor is None
             else loss_scale_factor)
    return mask_BT * (inv_seq / scale)
  raise ValueError(f"loss_agg_mode must be one of {', '.join(LOSS_AGG_MODES)}"
                   f', got {loss_agg_mode!r}.')


def kl_penalty(logp_BT: jax.Array, ref_logp_BT: jax.Array,
               estimator: str = 'k3') -> jax.Array:
  """Per-token estimate of KL(pi || ref) from the sampled tokens' log-probs.

  With d = ref - logp (Schulman's estimators, verl's names in brackets):
    'k1' ('kl')          -d = logp - ref     (unbiased; signed per token)
    'abs'                |d|
    'k2' ('mse')         d^2 / 2
    'k3' ('low_var_kl')  exp(d) - d - 1 >= 0, with verl's clamps: d to
                         [-20, 20] before exp, the value to [-10, 10].
  The clamps (on by default, as verl's low_var_kl) only bind where the
  policy has moved far from the reference on a token (k3 > 10 means
  ref - logp > 2.6 or < -11): such a token's penalty stops growing and its
  KL gradient is 0 (a clamped value is a constant), so one outlier token
  cannot dominate the step's loss or gradient; every other token is exact.
  TRL's k3 is unclamped (WORKSPACE.md "RL objectives").
  """
  kind = _KL_CANONICAL.get(estimator)
  d_BT = ref_logp_BT - logp_BT
  if kind == 'k1':
    return -d_BT
  if kind == 'abs':
    return jnp.abs(d_BT)
  if kind == 'k2':
    return 0.5 * jnp.square(d_BT)
  if kind == 'k3':
    d_BT = jnp.clip(d_BT, -K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return jnp.clip(jnp.exp(d_BT) - d_BT - 1.0, -K3_VALUE_CLAMP,
                    K3_VALUE_CLAMP)
  raise ValueError(f"kl_estimator must be one of {', '.join(KL_ESTIMATORS)}, "
                   f'got {estimator!r}.')


def policy_loss(logp_BT: jax.Array, old_logp_BT: jax.Array,
                ref_logp_BT: jax.Array | None, adv_B: jax.Array,
                mask_BT: jax.Array, *, eps_low: float, eps_high: float,
                beta: float, num_sequences_total: int | jax.Array | None = None,
                num_tokens_total: int | jax.Array | None = None,
                loss_agg_mode: str = 'seq-mean-token-mean',
                loss_scale_factor: float | None = None,
                clip_ratio_c: float | None = None,
                kl_estimator: str = 'k3', policy_loss_mode: str = 'ppo',
                gspo_eps_low: float = 3e-4, gspo_eps_high: float = 4e-4
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Clipped-ratio GRPO loss with a KL penalty; returns (loss, metrics).

  Per token, with ratio = exp(logp - old_logp) ('ppo'):
    pg = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
    loss_token = pg + beta * kl_penalty(logp, ref, kl_estimator)
  and the loss is sum(loss_token * w), w = `loss_weights` (loss_agg_mode,
  the step-level counts, loss_scale_factor). The asymmetric clip range is
  DAPO's "clip-higher" (Yu et al. 2025, Sec. 3.1).

  What the clip does depends on GRPO's mu (`rl.num_update_epochs`, the
  optimizer updates per rollout). With mu = 1 the only update runs at the
  policy that produced old_logp, so ratio = 1 at every token (up to the
  rounding between recompute and update, far inside the range): 1 lies inside
  [1 - eps_low, 1 + eps_high], the clipped and unclipped terms coincide in
  value and in gradient (-A * grad logp), and eps_low / eps_high change
  nothing (clip_frac is 0). With mu > 1 the later updates see ratio != 1 and
  the clip removes the gradient of tokens that moved past the range in the
  direction their advantage pushes.

  clip_ratio_c (dual-clip, Ye et al. 2019, arXiv:1912.09729; verl's name):
  for A < 0 the token loss is capped at -A * c (c > 1), so a token whose
  ratio ran far above 1 against a negative advantage no longer has an
  unbounded loss (its gradient is 0 past the cap). Off by default (None or
  0): at mu = 1 the ratio is 1 and it never acts; at mu > 1 it changes
  today's objective, so it is opt-in. verl's default is 3.0 (TRL's `delta`
  does the same: min(ratio, delta) in the unclipped term).

  policy_loss_mode 'gspo' (Zheng et al. 2025, arXiv:2507.18071): one ratio
  per sequence, s_i = exp(mean over its loss tokens of (logp - old_logp)),
  clipped to [1 - gspo_eps_low, 1 + gspo_eps_high] (the paper's 3e-4 /
  4e-4: s_i is a geometric mean, so it moves far less than a token ratio).
  It is computed in the token form s_i,t = sg[s_i] * exp(logp_t -
  sg[logp_t]) (value s_i, gradient s_i * grad logp_t per token), aggregated
  with 'seq-mean-token-mean' (the only mode allowed with 'gspo': GSPO's
  objective is a mean over sequences), which makes the gradient exactly
  the sequence-level one, -A_i s_i / |y_i| * sum_t grad logp_t. The
  dual-clip, when on, caps the sequence ratio the same way. At mu = 1,
  s_i = 1 and GSPO's gradient is GRPO's.

  A fully masked sequence contributes 0, still counts in the sequence
  mean (`loss_weights` says why), and never yields NaN, even if its
  log-probs are -inf. ref_logp_BT may be None when beta == 0; the KL
  terms are then 0.
  old_logp_BT and ref_logp_BT are constants (no gradient flows into them).

  Metrics, each summing over micro-batches to the step's value: loss,
  pg_loss and kl aggregated like the loss; ratio_mean (s_i with 'gspo'),
  clip_frac (share of tokens, or with 'gspo' of sequences, whose gradient
  the clip removes: ratio < 1 - eps_low with A < 0, or ratio > 1 + eps_high
  with A > 0) and dual_clip_frac (share capped by the dual-clip) as means
  over the step's loss tokens (num_tokens_total; without it this call's),
  or with 'gspo' over its sequences, in every loss_agg_mode.
  """
  check_objective(loss_agg_mode=loss_agg_mode, kl_estimator=kl_estimator,
                  policy_loss_mode=policy_loss_mode, clip_ratio_c=clip_ratio_c,
                  loss_scale_factor=loss_scale_factor)
  if ref_logp_BT is None and beta != 0:
    raise ValueError('beta != 0 needs ref_logp_BT.')
  if (loss_agg_mode == 'token-mean' and num_tokens_total is None
      and num_sequences_total is not None):
    # A caller that passes the step's sequence count is accumulating; the
    # token count of this micro-batch would not sum to the step's mean.
    raise ValueError("loss_agg_mode='token-mean' divides by the step's token "
                     'count: pass num_tokens_total (a micro-batch\'s own '
                     'count would not sum to the whole batch).')
  mask_BT = jnp.asarray(mask_BT, jnp.float32)
  valid_BT = mask_BT > 0
  # Zero the log-probs of masked tokens *before* exp: -inf or garbage there
  # would make inf * 0 = NaN in the value, and NaN in the gradient too.
  logp_BT = jnp.where(valid_BT, logp_BT.astype(jnp.float32), 0.0)
  old_logp_BT = jnp.where(valid_BT, jax.lax.stop_gradient(
      old_logp_BT.astype(jnp.float32)), 0.0)
  adv_B1 = jax.lax.stop_gradient(jnp.asarray(adv_B, jnp.float32))[:, None]
  w_BT = loss_weights(mask_BT, loss_agg_mode,
                      num_sequences_total=num_sequences_total,
                      num_tokens_total=num_tokens_total,
                      loss_scale_factor=loss_scale_factor)

  if policy_loss_mode == 'gspo':
    lo, hi = 1.0 - gspo_eps_low, 1.0 + gspo_eps_high
    len_B1 = jnp.maximum(mask_BT.sum(axis=1, keepdims=True), 1.0)
    log_s_B1 = jnp.sum((logp_BT - old_logp_BT) * mask_BT, axis=1,
                       keepdims=True) / len_B1
    # Capped as verl caps it (at 10): past that the clip zeroes the
    # gradient anyway, and exp must not overflow.
    log_s_B1 = jnp.minimum(log_s_B1, MAX_LOG_SEQ_RATIO)
    ratio_BT = jnp.exp(jax.lax.stop_gradient(log_s_B1) + logp_BT
                       - jax.lax.stop_gradient(logp_BT))
  else:
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    # The log-ratio clamped to +-20 as verl does: a token whose ratio
    # overflowed exp (log-ratio past 88.7) had a finite, clipped loss but
    # the gradient 0 * inf = NaN. Inside the clamp nothing changes; past
    # it the gradient is 0, as the clip (A > 0) or the dual-clip (A < 0)
    # would make it, and without the dual-clip an A < 0 token's loss is
    # e^20 |A| rather than inf.
    ratio_BT = jnp.exp(jnp.clip(logp_BT - old_logp_BT, -MAX_LOG_RATIO,
                                MAX_LOG_RATIO))
  clipped_BT = jnp.clip(ratio_BT, lo, hi)
  pg_BT = -jnp.minimum(ratio_BT * adv_B1, clipped_BT * adv_B1)
  is_clipped_BT = (((ratio_BT < lo) & (adv_B1 < 0))
                   | ((ratio_BT > hi) & (adv_B1 > 0)))
  if clip_ratio_c:
    cap_BT = -adv_B1 * clip_ratio_c
    is_dual_BT = (adv_B1 < 0) & (pg_BT > cap_BT)
    pg_BT = jnp.where(adv_B1 < 0, jnp.minimum(pg_BT, cap_BT), pg_BT)
  else:
    is_dual_BT = jnp.zeros_like(valid_BT)

  if ref_logp_BT is None:
    kl_BT = jnp.zeros_like(logp_BT)
  else:
    ref_logp_BT = jnp.where(valid_BT, jax.lax.stop_gradient(
        ref_logp_BT.astype(jnp.float32)), 0.0)
    kl_BT = kl_penalty(logp_BT, ref_logp_BT, kl_estimator)

  aggregate = lambda x_BT: jnp.sum(x_BT * w_BT)
  pg_loss = aggregate(pg_BT)
  kl = aggregate(kl_BT)
  loss = pg_loss + beta * kl
  # The ratio and clip statistics are shares whatever the loss's weights
  # (verl's masked means): of the step's tokens, or with 'gspo' of its
  # sequences (gspo's weights, 'seq-mean-token-mean', are those). The
  # token-sum modes' weights would give counts per sequence, or counts over
  # the Dr.GRPO constant.
  share_w_BT = w_BT if policy_loss_mode == 'gspo' else loss_weights(
      mask_BT, 'token-mean', num_tokens_total=num_tokens_total)
  share = lambda x_BT: jnp.sum(x_BT * share_w_BT)
  metrics = {'loss': loss, 'pg_loss': pg_loss, 'kl': kl,
             'ratio_mean': share(ratio_BT),
             'clip_frac': share(is_clipped_BT.astype(jnp.float32)),
             'dual_clip_frac': share(is_dual_BT.astype(jnp.float32))}
  return loss, jax.tree.map(jax.lax.stop_gradient, metrics)
