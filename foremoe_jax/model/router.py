"""Softmax top-k router with rollout routing replay (R3).

Shape letters: N tokens, E experts, K top-k.

Gates are always the softmax of the *current* router logits, read at the
chosen ids (and renormalised over them if the config says so). With replay the
ids come from the rollout's routing record instead of the top-k, so the router
still gets gradients through the gates (docs/design.md §4.4) and replaying the
model's own choices reproduces its outputs exactly.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Routing(NamedTuple):
  ids_NK: jax.Array  # int32, the experts used (replayed or chosen).
  gates_NK: jax.Array  # float32 combine weights.
  probs_NE: jax.Array  # float32 full softmax (for the balance loss).


def route(logits_NE, top_k: int, *, renormalize: bool, replay_ids_NK=None):
  probs_NE = jax.nn.softmax(logits_NE.astype(jnp.float32), axis=-1)
  if replay_ids_NK is None:
    _, ids_NK = jax.lax.top_k(probs_NE, top_k)
  else:
    ids_NK = replay_ids_NK
  ids_NK = ids_NK.astype(jnp.int32)
  gates_NK = jnp.take_along_axis(probs_NE, ids_NK, axis=-1)
  if renormalize:
    gates_NK = gates_NK / jnp.sum(gates_NK, axis=-1, keepdims=True)
  return Routing(ids_NK, gates_NK, probs_NE)


def expert_counts(ids_NK, valid_N, num_experts: int):
  """Assignments per expert over valid tokens: int32 [E]."""
  ids_A = jnp.where(valid_N[:, None], ids_NK, num_experts).reshape(-1)
  counts = jnp.zeros((num_experts + 1,), jnp.int32).at[ids_A].add(1)
  return counts[:num_experts]


def prob_sums(probs_NE, valid_N):
  """(sum of the router's probabilities over valid tokens [E], valid token
  count): the sums the balance loss averages, additive over devices."""
  w_N = valid_N.astype(jnp.float32)
  return (probs_NE * w_N[:, None]).sum(0), w_N.sum()


def balance_loss_from_sums(prob_sum_E, num_valid, counts_E):
  """Switch-Transformer auxiliary loss E * sum_e f_e * P_e (f: routed share,
  P: mean router probability), from batch-wide sums (any leading axes)."""
  num_experts = prob_sum_E.shape[-1]
  mean_prob_E = prob_sum_E / jnp.maximum(num_valid, 1.0)[..., None]
  counts_E = counts_E.astype(jnp.float32)
  frac_E = counts_E / jnp.maximum(counts_E.sum(-1, keepdims=True), 1.0)
  return num_experts * jnp.sum(jax.lax.stop_gradient(frac_E) * mean_prob_E,
                               axis=-1)


def balance_loss(probs_NE, counts_E, valid_N):
  """Switch-Transformer auxiliary loss E * sum_e f_e * P_e (f: routed share)."""
  prob_sum_E, num_valid = prob_sums(probs_NE, valid_N)
  return balance_loss_from_sums(prob_sum_E, num_valid, counts_E)
