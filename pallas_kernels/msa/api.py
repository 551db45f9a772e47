"""Public MSA API: one call per use, the implementation picked per backend.

The model calls three functions; every implementation returns the same
numbers (tests/msa holds them to the reference):

  out_BTHD, aux = msa_attention(q_BTHD, k_BSGD, v_BSGD, qi_BTGI, ki_BSI,
                                block_size=..., top_k=..., q_offset=0)
  loss = msa_indexer_kl_loss(q_BTHD, k_BSGD, qi_BTGI, ki_BSI, aux,
                             block_size=..., q_offset=0)
  out_BHD, aux = msa_decode(q_BHD, k_cache_BSGD, v_cache_BSGD, qi_BGI,
                            ki_cache_BSI, lengths_B, block_size=..., top_k=...)

and sizes its KV cache with decode_cache_len(max_len, block_size=...).

Each takes kv_valid_BS (bool [B, S], None: every key is real): padding keys
are masked in both branches (docs/design.md §6.9). Blocks stay at absolute
positions; the model aligns a left-padded row's first real token to a block
boundary before calling (model/attention.py), so a padded prompt selects
exactly the blocks it would select alone.

impl: 'auto' (XLA path on CPU, Pallas Mosaic on TPU, Pallas Triton on GPU),
'xla', 'pallas' (interpret=True on CPU; `pallas_backend` 'tpu' or 'gpu'
picks the lowering, default from the device, 'tpu' on CPU), 'reference'.

Letter key: B batch, T query tokens, S key/value tokens (kv_len, or cache
length at decode), H query heads, G KV groups, R = H / G, D head dim,
I index head dim, K = top_k, N = ceil(S / block_size).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.msa import indexer_loss
from pallas_kernels.msa import pallas_path
from pallas_kernels.msa import reference
from pallas_kernels.msa import xla

IMPLS = ('auto', 'xla', 'pallas', 'reference')
# The GPU kernel set (impl 'pallas' on a GPU): 'kv_outer', the two-launch
# selection with the KV-outer forward, dK/dV and split-K decode; 'token',
# the first kernels (fused selection, a program per token, atomic dK/dV),
# kept as the oracle and the fallback; 'tiles', the two-launch selection
# with union-tile forward and dQ (KV-outer dK/dV, split-K decode).
GPU_KERNELS = pallas_path.GPU_KERNELS


def resolve_impl(impl: str, pallas_backend: str | None = None):
  """(impl, pallas backend, interpret) for this process's default device."""
  if impl not in IMPLS:
    raise ValueError(f'impl must be one of {IMPLS}, got {impl!r}.')
  platform = jax.default_backend()
  if impl == 'auto':
    impl = 'xla' if platform == 'cpu' else 'pallas'
  backend = pallas_backend or pallas_path.default_backend()
  if backend not in ('tpu', 'gpu'):
    raise ValueError(f"pallas_backend must be 'tpu' or 'gpu', got {backend!r}.")
  return impl, backend, platform == 'cpu'


def _check_prefill(q_BTHD, k_BSGD, v_BSGD, qi_BTGI, ki_BSI, block_size, top_k,
                   q_offset):
  if q_BTHD.ndim != 4 or k_BSGD.ndim != 4 or v_BSGD.shape != k_BSGD.shape:
    raise ValueError(f'need q [B,T,H,D], k=v [B,S,G,D]; got q {q_BTHD.shape}, '
                     f'k {k_BSGD.shape}, v {v_BSGD.shape}.')
  b, t, h, d = q_BTHD.shape
  bk, s, g, dk = k_BSGD.shape
  if bk != b or dk != d or h % g:
    raise ValueError(f'q {q_BTHD.shape} and k {k_BSGD.shape} disagree: same B '
                     f'and D needed, and H divisible by G.')
  if qi_BTGI.shape[:3] != (b, t, g) or ki_BSI.shape[:2] != (b, s) or \
      ki_BSI.shape[2] != qi_BTGI.shape[3]:
    raise ValueError(f'need qi [B,T,G,I] = [{b},{t},{g},I] and ki [B,S,I] = '
                     f'[{b},{s},I]; got qi {qi_BTGI.shape}, ki {ki_BSI.shape}.')
  _check_budget(block_size, top_k)
  if not isinstance(q_offset, (int, np.integer)) or not 0 <= q_offset <= s - t:
    raise ValueError(f'q_offset must be a Python int with 0 <= q_offset <= '
                     f'kv_len - q_len = {s - t}; got {q_offset!r}.')


def _check_valid(kv_valid_BS, b: int, s: int):
  if kv_valid_BS is not None and jnp.shape(kv_valid_BS) != (b, s):
    raise ValueError(f'kv_valid_BS must be bool [B, S] = [{b}, {s}], got '
                     f'{jnp.shape(kv_valid_BS)}.')


def _check_budget(block_size, top_k):
  if not (isinstance(block_size, int) and block_size >= 1):
    raise ValueError(f'block_size must be a positive int, got {block_size!r}.')
  if not (isinstance(top_k, int) and top_k >= 1):
    raise ValueError(f'top_k must be a positive int (the local block counts), '
                     f'got {top_k!r}.')


def msa_attention(q_BTHD, k_BSGD, v_BSGD, qi_BTGI, ki_BSI, *, block_size: int,
                  top_k: int, q_offset: int = 0, impl: str = 'auto',
                  pallas_backend: str | None = None, kv_valid_BS=None,
                  gpu_kernels: str = 'kv_outer'):
  """MSA prefill / training attention (docs/design.md §6.1-6.4, 6.9).

  Args:
    q_BTHD: queries [B, T, H, D]; head h is in group h // (H / G).
    k_BSGD, v_BSGD: keys/values [B, S, G, D], S = kv_len >= T.
    qi_BTGI: index queries, one head per group, [B, T, G, I].
    ki_BSI: index keys, one head shared by all groups, [B, S, I].
    block_size: C, key block length. S need not be a multiple of it.
    top_k: K, blocks kept per query, the local block included.
    q_offset: query t sits at position t + q_offset; kv_len - q_len for a
      chunk of a longer prompt (the cache then holds all S keys), else 0.
    kv_valid_BS: bool [B, S], False at padding keys: they score -inf in the
      index branch (an all-padding block is never selected) and are never
      attended. A query that sees no valid key gets out 0, lse -inf.
    gpu_kernels: the Pallas GPU kernel set (`GPU_KERNELS`).

  Returns:
    out_BTHD in q's dtype, and aux = {'sel_BGTK': int32 [B, G, T, K] (block
    ids, local block in the last valid slot, -1 padding), 'lse_BTH': f32
    [B, T, H] main-branch log-sum-exp}. Gradients flow to q, k, v (the
    selection is discrete, so qi and ki learn only from msa_indexer_kl_loss).
  """
  _check_prefill(q_BTHD, k_BSGD, v_BSGD, qi_BTGI, ki_BSI, block_size, top_k,
                 q_offset)
  _check_valid(kv_valid_BS, *k_BSGD.shape[:2])
  impl, backend, interpret = resolve_impl(impl, pallas_backend)
  kw = dict(block_size=block_size, top_k=top_k, q_offset=int(q_offset),
            kv_valid_BS=kv_valid_BS)
  if impl == 'reference':
    return reference.msa_attention(q_BTHD, k_BSGD, v_BSGD, qi_BTGI, ki_BSI,
                                   **kw)
  if impl == 'xla':
    return xla.msa_attention(q_BTHD, k_BSGD, v_BSGD, qi_BTGI, ki_BSI, **kw)
  return pallas_path.msa_attention(q_BTHD, k_BSGD, v_BSGD, qi_BTGI, ki_BSI,
                                   backend=backend, interpret=interpret,
                                   gpu_kernels=_gpu_kernels(gpu_kernels), **kw)


def _gpu_kernels(gpu_kernels: str) -> str:
  if gpu_kernels not in GPU_KERNELS:
    raise ValueError(f'gpu_kernels must be one of {GPU_KERNELS}, got '
                     f'{gpu_kernels!r}.')
  return gpu_kernels


def msa_indexer_kl_loss(q_BTHD, k_BSGD, qi_BTGI, ki_BSI, aux, *,
                        block_size: int, q_offset: int = 0,
                        impl: str = 'auto', weight_BT=None,
                        kv_valid_BS=None) -> jax.Array:
  """docs/design.md §6.5: mean over (b, g, t) of KL(main || index dist).

  Pass the same q, k, qi, ki and the aux that msa_attention returned (its
  'sel_BGTK' and 'lse_BTH'). The target (main attention averaged over the
  group's heads, over the selected causal keys) is stop-gradient; only qi and
  ki receive gradient. Scalar f32. 'pallas' and 'auto' use the XLA
  implementation (there is no loss kernel); 'reference' is the dense one.

  weight_BT: float weights of the query positions: the loss is then
  sum_{b,t} weight[b, t] * mean_g KL[b, g, t] (a masked mean for weights
  mask / mask.sum()); None is the plain mean, weights 1 / (B T).
  kv_valid_BS: the mask given to msa_attention; padding keys are in neither
  distribution, and a query with no valid key adds KL 0.
  """
  if impl not in IMPLS:
    raise ValueError(f'impl must be one of {IMPLS}, got {impl!r}.')
  _check_budget(block_size, aux['sel_BGTK'].shape[-1])
  _check_valid(kv_valid_BS, *k_BSGD.shape[:2])
  if impl == 'reference':
    return reference.indexer_kl_loss(q_BTHD, k_BSGD, qi_BTGI, ki_BSI,
                                     aux['sel_BGTK'], block_size=block_size,
                                     q_offset=q_offset, weight_BT=weight_BT,
                                     kv_valid_BS=kv_valid_BS)
  return indexer_loss.indexer_kl_loss(q_BTHD, k_BSGD, qi_BTGI, ki_BSI,
                                      aux['sel_BGTK'], aux['lse_BTH'],
                                      block_size=block_size, q_offset=q_offset,
                                      weight_BT=weight_BT,
                                      kv_valid_BS=kv_valid_BS)


def msa_decode(q_BHD, k_cache_BSGD, v_cache_BSGD, qi_BGI, ki_cache_BSI,
               lengths_B, *, block_size: int, top_k: int, impl: str = 'auto',
               pallas_backend: str | None = None, kv_valid_BS=None,
               gpu_kernels: str = 'kv_outer'):
  """MSA for one new token per sequence against a KV cache.

  Args:
    q_BHD: the new token's queries [B, H, D].
    k_cache_BSGD, v_cache_BSGD: caches [B, S, G, D] that already hold the new
      token's key/value at position lengths_B - 1; entries past the length
      are ignored. S = decode_cache_len(max_len) avoids a pad (a copy of
      the cache) at every step.
    qi_BGI: the new token's index queries [B, G, I].
    ki_cache_BSI: index-key cache [B, S, I], filled like k_cache.
    lengths_B: int [B], valid cache entries per sequence, new token included
      (1 <= length <= S).
    kv_valid_BS: bool [B, S], False at padding keys in the cache (None: all
      entries below the length are real).

  Returns:
    out_BHD, and aux = {'sel_BGK': int32 [B, G, K], 'lse_BH': f32 [B, H]}:
    the last row of msa_attention over the first `length` tokens.
  """
  b, h, d = q_BHD.shape
  s, g = k_cache_BSGD.shape[1:3]
  if k_cache_BSGD.shape[0] != b or k_cache_BSGD.shape[3] != d or h % g or \
      v_cache_BSGD.shape != k_cache_BSGD.shape:
    raise ValueError(f'need q [B,H,D] and k=v caches [B,S,G,D] with G | H; '
                     f'got q {q_BHD.shape}, k {k_cache_BSGD.shape}, '
                     f'v {v_cache_BSGD.shape}.')
  if qi_BGI.shape[:2] != (b, g) or ki_cache_BSI.shape[:2] != (b, s):
    raise ValueError(f'need qi [B,G,I] and ki cache [B,S,I]; got '
                     f'{qi_BGI.shape}, {ki_cache_BSI.shape}.')
  if jnp.shape(lengths_B) != (b,):
    raise ValueError(f'lengths_B must be [B]={b}, got {jnp.shape(lengths_B)}.')
  _check_budget(block_size, top_k)
  _check_valid(kv_valid_BS, b, s)
  impl, backend, interpret = resolve_impl(impl, pallas_backend)
  kw = dict(block_size=block_size, top_k=top_k, kv_valid_BS=kv_valid_BS)
  if impl == 'reference':
    off_B = jnp.asarray(lengths_B, jnp.int32) - 1
    out, aux = reference.msa_attention(q_BHD[:, None], k_cache_BSGD,
                                       v_cache_BSGD, qi_BGI[:, None],
                                       ki_cache_BSI, q_offset=off_B, **kw)
    return out[:, 0], {'sel_BGK': aux['sel_BGTK'][:, :, 0],
                       'lse_BH': aux['lse_BTH'][:, 0]}
  if impl == 'xla':
    return xla.msa_decode(q_BHD, k_cache_BSGD, v_cache_BSGD, qi_BGI,
                          ki_cache_BSI, jnp.asarray(lengths_B), **kw)
  return pallas_path.msa_decode(q_BHD, k_cache_BSGD, v_cache_BSGD, qi_BGI,
                                ki_cache_BSI, jnp.asarray(lengths_B),
                                backend=backend, interpret=interpret,
                                gpu_kernels=_gpu_kernels(gpu_kernels), **kw)


def decode_cache_len(max_len: int, *, block_size: int, impl: str = 'auto',
                     pallas_backend: str | None = None) -> int:
  """The KV-cache length to allocate for decoding up to max_len tokens.

  The Pallas decode pads a cache whose length is not a whole number of its
  tiles, a copy of the whole cache at every step; this rounds max_len up
  to the least length it reads in place (pallas_path.decode_cache_len).
  The XLA path reads any length in place: max_len itself.
  """
  if max_len < 1:
    raise ValueError(f'max_len must be >= 1, got {max_len}.')
  impl, backend, _ = resolve_impl(impl, pallas_backend)
  if impl != 'pallas':
    return int(max_len)
  return pallas_path.decode_cache_len(int(max_len), block_size, backend)
