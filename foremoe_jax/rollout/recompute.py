"""Decoding without a KV cache: one full forward over the buffer per token.

The baseline the cached sampler is measured against (experiments/
bench_sampler.py) and an independent reference for it: one `lax.fori_loop`
over a fixed-length token buffer [B, T], each step rerunning the model on all
T positions and sampling from the logits at the last filled one. Causal
attention makes the not-yet-written PAD columns irrelevant to those logits,
so greedy decoding here equals the cached sampler's token for token.

Shape letters: B samples, P prompt tokens, C completion tokens, T = P + C,
V vocab.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from foremoe_jax.rollout import sampler as sampler_lib


def recompute_decode(graphdef, state, prompts_BP, key, params, *,
                     num_steps: int | None = None, placement=None,
                     capacity: int | None = None):
  """Tokens int32 [B, P + C] after `num_steps` (default C) recompute steps.

  Same sampling rule and keys as `Sampler` (step i samples with
  fold_in(key, i)) and the same EOS handling (PAD after EOS); no early exit,
  so every step costs the same. Jit it with `params` and `num_steps` static.
  B * (P + C) must split over the mesh's devices.
  """
  num_rows, plen = prompts_BP.shape
  total = plen + params.max_new_tokens
  num_steps = params.max_new_tokens if num_steps is None else num_steps
  model = nnx.merge(graphdef, state)
  tokens_BT = jnp.full((num_rows, total), params.pad_id, jnp.int32)
  tokens_BT = tokens_BT.at[:, :plen].set(prompts_BP)

  def body(i, carry):
    tokens_BT, alive_B = carry
    pos = plen + i  # The column to fill; its logits sit one to the left.
    # Left-padded prompts: their leading PADs are hidden as in the sampler.
    valid_BT = sampler_lib.prompt_valid(tokens_BT, params.pad_id)
    logits_BTV, _, _ = model(tokens_BT, valid_BT=valid_BT, placement=placement,
                             capacity=capacity)
    logits_BV = jax.lax.dynamic_index_in_dim(logits_BTV, pos - 1, axis=1,
                                             keepdims=False)
    new_B = sampler_lib.sample_tokens(logits_BV, jax.random.fold_in(key, i),
                                      params)
    new_B = jnp.where(alive_B, new_B, params.pad_id)
    tokens_BT = jax.lax.dynamic_update_slice_in_dim(tokens_BT, new_B[:, None],
                                                    pos, axis=1)
    return tokens_BT, alive_B & ~sampler_lib.ends(new_B, params)

  alive_B = jnp.ones((num_rows,), bool)
  tokens_BT, _ = jax.lax.fori_loop(0, num_steps, body, (tokens_BT, alive_B))
  return tokens_BT
