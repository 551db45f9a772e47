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
  onehot = jax.nn.one_hot(ids_NK, num_experts, dtype=jnp.int32)
  return jnp.sum(onehot * valid_N[:, None, None].astype(jnp.int32), axis=(0, 1))


def balance_loss(probs_NE, counts_E, valid_N):
  """Switch-Transformer auxiliary loss E * sum_e f_e * P_e (f: routed share)."""
  num_experts = probs_NE.shape[-1]
  w_N = valid_N.astype(jnp.float32)
  mean_prob_E = (probs_NE * w_N[:, None]).sum(0) / jnp.maximum(w_N.sum(), 1.0)
  frac_E = counts_E / jnp.maximum(counts_E.sum(), 1)
  return num_experts * jnp.sum(jax.lax.stop_gradient(frac_E) * mean_prob_E)
