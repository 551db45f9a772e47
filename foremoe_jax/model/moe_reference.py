"""Single-device reference for the routed experts: a plain loop over experts.

Independent of slots, placements, capacities and collectives, so it is the
yardstick that the expert-parallel path (expert_parallel.py) must match when
its capacity bucket drops nothing.
"""
import jax
import jax.numpy as jnp


def reference_moe_ffn(x_NM, ids_NK, gates_NK, valid_N, wg_EMF, wu_EMF, wd_EFM):
  y_NM = jnp.zeros_like(x_NM)
  for e in range(wg_EMF.shape[0]):
    h = jax.nn.silu(x_NM @ wg_EMF[e]) * (x_NM @ wu_EMF[e])
    out_NM = h @ wd_EFM[e]
    w_N = jnp.where(valid_N, (gates_NK * (ids_NK == e)).sum(axis=-1), 0.0)
    y_NM = y_NM + w_N[:, None] * out_NM
  return y_NM
