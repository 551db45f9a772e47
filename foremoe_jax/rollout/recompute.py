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
                     capacity: int | None = None, bucket: int | None = None):
  """Tokens int32 [B, P + C] after `num_steps` (default C) recompute steps.

  Same sampling rule and keys as `Sampler` (step i samples with
  fold_in(key, i)) and the same EOS handling (PAD after EOS); no early exit.
  bucket: None reruns the whole [B, P + C] buffer every step (every step
  costs the same); an int reruns only the filled prefix, rounded up to a
  multiple of `bucket` columns (one loop per prefix width, each compiled
  once: the strongest cache-free decode that jit allows without a compile
  per length). Jit it with `params`, `num_steps` and `bucket` static.
  B times every width run must split over the mesh's devices.
  """
  num_rows, plen = prompts_BP.shape
  total = plen + params.max_new_tokens
  num_steps = params.max_new_tokens if num_steps is None else num_steps
  if bucket is not None and bucket < 1:
    raise ValueError(f'bucket must be >= 1 (or None), got {bucket}.')
  model = nnx.merge(graphdef, state)
  tokens_BT = jnp.full((num_rows, total), params.pad_id, jnp.int32)
  tokens_BT = tokens_BT.at[:, :plen].set(prompts_BP)

  def step(width):
    def body(i, carry):
      tokens_BT, alive_B = carry
      pos = plen + i  # The column to fill; its logits sit one to the left.
      # Causal: the columns from `width` on cannot change logits at pos - 1.
      in_BW = tokens_BT[:, :width]
      # Left-padded prompts: their leading PADs are hidden as in the sampler.
      valid_BW = sampler_lib.prompt_valid(in_BW, params.pad_id)
      logits_BWV, _, _ = model(in_BW, valid_BT=valid_BW, placement=placement,
                               capacity=capacity)
      logits_BV = jax.lax.dynamic_index_in_dim(logits_BWV, pos - 1, axis=1,
                                               keepdims=False)
      new_B = sampler_lib.sample_tokens(logits_BV, jax.random.fold_in(key, i),
                                        params)
      new_B = jnp.where(alive_B, new_B, params.pad_id)
      tokens_BT = jax.lax.dynamic_update_slice_in_dim(
          tokens_BT, new_B[:, None], pos, axis=1)
      return tokens_BT, alive_B & ~sampler_lib.ends(new_B, params)
    return body

  carry = (tokens_BT, jnp.ones((num_rows,), bool))
  if bucket is None:
    return jax.lax.fori_loop(0, num_steps, step(total), carry)[0]
  # Step i reads columns [0, plen + i): the steps whose inputs fit `width`
  # columns run at that width, the next ones at the next multiple.
  i = 0
  while i < num_steps:
    width = min(total, -(-(plen + i) // bucket) * bucket)
    end = min(num_steps, width - plen + 1)
    carry = jax.lax.fori_loop(i, end, step(width), carry)
    i = end
  return carry[0]
