"""The MSA index branch of a layer, initialised from its own dense q/k weights.

Sits in the HF import (convert.py): a dense checkpoint has no index-branch
weights, so when the model config makes a layer MSA (docs/design.md §6) and
the checkpoint holds no `self_attn.indexer.*` tensors for it, its
`qi_proj`, `ki_proj`, `qi_norm`, `ki_norm` are derived here, on the host in
numpy, from that layer's q_proj, k_proj, q_norm and k_norm. A random index
branch would select arbitrary key blocks until the indexer KL (§6.5) has
trained it; this one starts as a low-rank copy of the attention the
checkpoint already computes, so the first selections follow the dense
attention logits (docs/design.md §6.10).

The rule, and why:
  * RoPE frequencies. Our RoPE (`layers.apply_rope`, half-split) rotates
    pair i of a D-dim head, dims (i, i + D/2), at theta^(-2i/D); the
    index head's pair j, dims (j, j + I/2), rotates at theta^(-2j/I). Pair j
    of the index head therefore copies main pair i_j = j * D / I, which
    rotates at the same frequency, so the index head's RoPE applied to the
    copied dims equals the main head's RoPE restricted to them. Exact when
    I divides D; otherwise i_j = round(j * D / I) (nearest, capped at
    D/2 - 1) and the frequencies are only approximately equal.
  * Projections. The index branch has one query head per KV group and one
    key head shared by all groups: qi_proj for group g is the mean over the
    group's R = H / G query heads of q_proj's columns at the chosen dims,
    and ki_proj is the mean over the G kv heads of k_proj's columns there.
  * Norm scales. With qk_norm_scope 'head' (Qwen3) q_norm / k_norm hold one
    [D] scale shared by every head (so the mean over heads is the scale
    itself): the index norms take it at the chosen dims. Otherwise the
    scales are ones: with no q/k norm there is no scale to copy (the index
    branch always normalises; ones is RMSNorm's neutral scale), and OLMoE's
    'full' norm divides by the RMS over all H * D (or G * D) outputs, not
    over one head, so its per-(head, dim) scales were trained against
    another normaliser and do not carry over to an I-dim per-head norm.

Consequence (tests/hf/test_hf_msa.py): with one query head per group and
one kv head (R = G = 1), qk_norm_scope 'head' and I == D, the chosen dims
are all dims in order, qi == q and ki == k, so the index logits
qi.ki / sqrt(I) equal the attention logits q.k / sqrt(D) and the first
selection is the top-k blocks of the dense logits' block maxima. With
I < D the index norm's RMS is over the chosen dims only, so the scores
are an approximation of the attention logits, not a multiple of them.

Shape letters: M model dim, H query heads, G KV groups (heads), R = H / G,
D head dim, I index head dim.
"""
from __future__ import annotations

import numpy as np

from foremoe_jax import config as config_lib
from foremoe_jax.hf import tensors as tensors_lib


def rope_pair_dims(head_dim: int, index_dim: int) -> np.ndarray:
  """int [I]: the head dims the index head's dims copy, in index-head order.

  Index pair j (dims j, j + I/2) takes main pair i_j = j * D / I (dims i_j,
  i_j + D/2), rounded to the nearest pair when I does not divide D.
  """
  half_d, half_i = head_dim // 2, index_dim // 2
  pair_I = np.minimum(np.floor(np.arange(half_i) * head_dim / index_dim + 0.5),
                      half_d - 1).astype(np.int64)
  return np.concatenate([pair_I, pair_I + half_d])


def rope_frequencies_exact(head_dim: int, index_dim: int) -> bool:
  """Whether every copied pair rotates at exactly the index pair's frequency."""
  return head_dim % index_dim == 0


def index_branch_from_dense(model_cfg, q_kernel_MX, k_kernel_MY, q_scale=None,
                            k_scale=None) -> dict[str, np.ndarray]:
  """One layer's index branch in our layout (module docstring for the rule).

  q_kernel_MX [M, H * D], k_kernel_MY [M, G * D]: the layer's q_proj and
  k_proj kernels; q_scale, k_scale: its q_norm / k_norm scales ([D] with
  qk_norm_scope 'head'; ignored otherwise). Returns float32 arrays by
  parameter name: 'qi_proj' [M, G * I], 'ki_proj' [M, I], 'qi_norm' [I],
  'ki_norm' [I].
  """
  h, g = model_cfg.num_heads, model_cfg.num_kv_heads
  d, i = model_cfg.head_dim, model_cfg.msa_index_dim
  dims_I = rope_pair_dims(d, i)
  q_MGRD = np.asarray(q_kernel_MX, np.float64).reshape(-1, g, h // g, d)
  k_MGD = np.asarray(k_kernel_MY, np.float64).reshape(-1, g, d)
  m = q_MGRD.shape[0]
  qi_MGI = q_MGRD[..., dims_I].mean(axis=2)
  ki_MI = k_MGD[..., dims_I].mean(axis=1)
  per_head = (model_cfg.qk_norm
              and model_cfg.get('qk_norm_scope', 'head') == 'head')
  ones_I = np.ones((i,))
  qi_scale_I = np.asarray(q_scale, np.float64)[dims_I] if per_head else ones_I
  ki_scale_I = np.asarray(k_scale, np.float64)[dims_I] if per_head else ones_I
  out = dict(qi_proj=qi_MGI.reshape(m, g * i), ki_proj=ki_MI,
             qi_norm=qi_scale_I, ki_norm=ki_scale_I)
  return {name: np.ascontiguousarray(x, np.float32) for name, x in out.items()}


def index_tensors_from_hf(model_cfg, tensors, layers) -> dict[str, np.ndarray]:
  """HF key -> float32 tensor ([out, in] Linear layout, as a checkpoint
  stores it) of the index branch of each layer in `layers`, derived from
  that layer's dense tensors in `tensors` (HF key -> array, any float
  dtype)."""
  types = config_lib.layer_attention_types(model_cfg)
  out = {}
  for layer in layers:
    if types[layer] != 'msa':
      raise ValueError(f'layer {layer} is not an MSA layer of the model config')
    key = lambda name: tensors_lib.attn_key(layer, name)
    scale = lambda name: (np.asarray(tensors[key(name)])
                          if model_cfg.qk_norm else None)
    branch = index_branch_from_dense(
        model_cfg, np.asarray(tensors[key('q_proj')]).T,
        np.asarray(tensors[key('k_proj')]).T, scale('q_norm'),
        scale('k_norm'))
    for name, x in branch.items():
      hf_x = x.T if name.endswith('_proj') else x
      out[tensors_lib.attn_key(layer, tensors_lib.INDEX_NAMES[name])] = \
          np.ascontiguousarray(hf_x)
  return out
