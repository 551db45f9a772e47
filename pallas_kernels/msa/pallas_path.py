"""MSA on the Pallas kernels: layouts, padding and the custom_vjp.

The kernels want padded, backend-specific layouts; this module converts the
model's [B, T, H, D] / [B, S, G, D] arrays in and out, so the API stays the
same on every backend:

* TPU: group-major q [B, G, T, R*D] and k/v [B, G, S, D] (every block then
  ends in full-extent dims, which Mosaic always accepts), T padded to the
  query tile, S to the block size.
* GPU: q [B, T, G, R', D'] with the group's heads padded to R' >= 16 rows
  (tl.dot's minimum) and D, K padded to powers of two, as Triton tiles need.

Padding is inert: padded keys sit past every query position, padded query
rows and -1 selection slots see no key, and zero rows of q and dO add nothing
to dK/dV. Padding *keys* of the caller (kv_valid_BS False, e.g. a
left-padded prompt's PADs) go to every kernel as an int32 mask (padded
with 0 like the keys); None passes an all-ones mask.

Letter key: B batch, T query tokens, S key tokens, H query heads, G groups,
R heads per group, D head dim, I index head dim, K selected blocks.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.msa import backward_kernel
from pallas_kernels.msa import decode_kernel
from pallas_kernels.msa import forward_kernel
from pallas_kernels.msa import index_kernel
from pallas_kernels.msa import kernel_common as kc
from pallas_kernels.msa import kv_outer
from pallas_kernels.msa import select_kernel


def default_backend() -> str:
  """'gpu' on CUDA/ROCm devices, else 'tpu' (also the CPU interpret choice)."""
  return 'gpu' if jax.default_backend() in ('gpu', 'cuda', 'rocm') else 'tpu'


def tpu_q_tile(t: int) -> int:
  # Lane-dim blocks of the dK/dV kernel need Tq % 128 == 0 or Tq == T.
  return kc.round_up(t, 8) if t <= 128 else 128


def check_block_size(block_size: int, backend: str):
  if backend == 'gpu' and (block_size < 16 or
                           block_size != kc.next_pow2(block_size)):
    raise ValueError(f'GPU MSA kernels need a power-of-two block_size >= 16 '
                     f'(Triton tiles), got {block_size}.')
  if backend == 'tpu' and block_size % 8:
    raise ValueError(f'TPU MSA kernels need block_size % 8 == 0 (sublane '
                     f'tiling), got {block_size}.')


# ----------------------------------------------------------------------------
# Layouts


def _pad_axis(x, axis: int, size: int, value=0):
  if x.shape[axis] == size:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad, constant_values=value)


def _to_group_major_q(x_BTHD, g: int, tp: int):
  b, t, h, d = x_BTHD.shape
  x = x_BTHD.reshape(b, t, g, (h // g) * d).transpose(0, 2, 1, 3)
  return _pad_axis(x, 2, tp)


def _from_group_major_q(x_BGTX, t: int, h: int):
  b, g, _, x = x_BGTX.shape
  d = x // (h // g)
  return x_BGTX[:, :, :t].transpose(0, 2, 1, 3).reshape(b, t, h, d)


def _to_group_major_kv(x_BSGD, sp: int):
  return _pad_axis(x_BSGD, 1, sp).transpose(0, 2, 1, 3)


def _rows_BTH(x_BGTR, t: int):
  b, g, _, r = x_BGTR.shape
  return x_BGTR[:, :, :t].transpose(0, 2, 1, 3).reshape(b, t, g * r)


def _to_gpu_q(x_BTHD, g: int, rp: int, dp: int):
  b, t, h, d = x_BTHD.shape
  x = x_BTHD.reshape(b, t, g, h // g, d)
  return _pad_axis(_pad_axis(x, 3, rp), 4, dp)


def _gpu_dims(r: int, d: int, k: int):
  return max(16, kc.next_pow2(r)), max(16, kc.next_pow2(d)), kc.next_pow2(k)


def _valid_mask(valid_BS, b: int, s: int, sp: int):
  """int32 [B, Sp] key-valid mask: 1 at real keys, 0 at padding (ours and
  the caller's)."""
  valid = (jnp.ones((b, s), jnp.int32) if valid_BS is None
           else jnp.asarray(valid_BS).astype(jnp.int32))
  return _pad_axis(valid, 1, sp)


# ----------------------------------------------------------------------------
# Forward / backward


def _kv_outer_heads(r: int, t: int) -> int:
  """Padded heads per group of the KV-outer layout: a power of two, and at
  least 16 when a tile holds one query (decode), tl.dot's minimum rows."""
  return kc.next_pow2(r) if t > 1 else max(16, kc.next_pow2(r))


def _gpu_operands(q_BTHD, k_BSGD, v_BSGD, valid_BS, *, block_size,
                  heads_p: int):
  """The GPU forward kernels' padded operands: (q_BTGRD, k_BSGD, v_BSGD,
  valid_BS int32, scale), heads padded to heads_p, the head dim to a power
  of two and the keys to whole blocks."""
  b, t, h, d = q_BTHD.shape
  s, g = k_BSGD.shape[1:3]
  dp = _gpu_dims(h // g, d, 1)[1]
  sp = kc.round_up(s, block_size)
  pad_kv = lambda x: _pad_axis(_pad_axis(x, 1, sp), 3, dp)
  return (_to_gpu_q(q_BTHD, g, heads_p, dp), pad_kv(k_BSGD), pad_kv(v_BSGD),
          _valid_mask(valid_BS, b, s, sp), 1.0 / math.sqrt(d))


def kv_outer_operands(q_BTHD, k_BSGD, v_BSGD, valid_BS, *, block_size):
  """The KV-outer kernels' padded operands (`_gpu_operands`, heads padded
  to `_kv_outer_heads`)."""
  r = q_BTHD.shape[2] // k_BSGD.shape[2]
  return _gpu_operands(q_BTHD, k_BSGD, v_BSGD, valid_BS,
                       block_size=block_size,
                       heads_p=_kv_outer_heads(r, q_BTHD.shape[1]))


def sparse_forward(q_BTHD, k_BSGD, v_BSGD, sel_BGTK, off_B, valid_BS=None, *,
                   block_size, backend, interpret, gpu_kernels='kv_outer',
                   kv_config: kv_outer.ForwardConfig | None = None):
  """(out_BTHD, lse_BTH f32) from the kernel of the chosen backend.

  gpu_kernels: 'kv_outer' (kv_outer.py: tiles of queries per key block,
  split-K at one query), 'token' (forward_kernel.py: a program per token
  and group) or 'tiles' (forward_kernel.forward_gpu_tiles: a few
  neighbouring tokens per program against the union of their blocks;
  split-K at one query). kv_config: the KV-outer kernel's knobs (None:
  defaults).
  """
  b, t, h, d = q_BTHD.shape
  s, g = k_BSGD.shape[1:3]
  r = h // g
  if backend == 'tpu':
    scale = 1.0 / math.sqrt(d)
    sp = kc.round_up(s, block_size)
    valid = _valid_mask(valid_BS, b, s, sp)
    tq = tpu_q_tile(t)
    tp = kc.round_up(t, tq)
    o, lse = forward_kernel.forward_tpu(
        _to_group_major_q(q_BTHD, g, tp), _to_group_major_kv(k_BSGD, sp),
        _to_group_major_kv(v_BSGD, sp), _pad_axis(sel_BGTK, 2, tp, -1), off_B,
        valid, block_size=block_size, n_heads=r, q_tile=tq, scale=scale,
        interpret=interpret)
    return _from_group_major_q(o, t, h), _rows_BTH(lse, t)
  _check_gpu_kernels(gpu_kernels)
  if gpu_kernels == 'tiles' and t > 1:
    kp = _gpu_dims(r, d, sel_BGTK.shape[-1])[2]
    q_p, k_p, v_p, valid, scale = _gpu_operands(
        q_BTHD, k_BSGD, v_BSGD, valid_BS, block_size=block_size,
        heads_p=kc.next_pow2(r))
    o, lse = forward_kernel.forward_gpu_tiles(
        q_p, k_p, v_p, _pad_axis(sel_BGTK, 3, kp, -1), off_B, valid,
        block_size=block_size, scale=scale, interpret=interpret)
  elif gpu_kernels in ('kv_outer', 'tiles'):
    # (tiles at one query per sequence: decode's split-K)
    q_p, k_p, v_p, valid, scale = kv_outer_operands(
        q_BTHD, k_BSGD, v_BSGD, valid_BS, block_size=block_size)
    if valid_BS is None and k_p.shape[1] == s:
      # No key is padding: no [B, S] mask of ones to write and read (a
      # decode step's whole cache length, every step).
      valid = None
    o, lse = kv_outer.forward(
        q_p, k_p, v_p, sel_BGTK, off_B, valid, block_size=block_size,
        scale=scale, interpret=interpret, config=kv_config)
  else:
    rp, _, kp = _gpu_dims(r, d, sel_BGTK.shape[-1])
    q_p, k_p, v_p, valid, scale = _gpu_operands(
        q_BTHD, k_BSGD, v_BSGD, valid_BS, block_size=block_size, heads_p=rp)
    o, lse = forward_kernel.forward_gpu(
        q_p, k_p, v_p, _pad_axis(sel_BGTK, 3, kp, -1), off_B, valid,
        block_size=block_size, scale=scale, interpret=interpret)
  return (o[:, :, :, :r, :d].reshape(b, t, h, d),
          lse[..., :r].reshape(b, t, h))


def _selector(gpu_kernels: str) -> str:
  """The GPU selection kernel of a kernel set: the two-launch one with the
  KV-outer and union-tile kernels, the fused one with the per-token
  kernels."""
  return 'fused' if gpu_kernels == 'token' else 'two_pass'


GPU_KERNELS = ('kv_outer', 'token', 'tiles')


def _check_gpu_kernels(gpu_kernels: str):
  if gpu_kernels not in GPU_KERNELS:
    raise ValueError(f'gpu_kernels must be one of {GPU_KERNELS}, got '
                     f'{gpu_kernels!r}.')


def sparse_backward(q_BTHD, k_BSGD, v_BSGD, sel_BGTK, off_B, valid_BS,
                    out_BTHD, lse_BTH, dout_BTHD, dlse_BTH, *, block_size,
                    backend, interpret, gpu_kernels='kv_outer',
                    parts: str = 'all', dkv_prefetch: bool = False,
                    dkv_parts: int | None = None):
  """(dq, dk, dv) in the input dtypes.

  GPU, gpu_kernels='kv_outer': dq per token, dK/dV KV-outer, no atomics
  (deterministic); 'tiles': dq by union tiles (backward_kernel.dq_gpu_tiles),
  dK/dV KV-outer, no atomics either; 'token': one kernel, dK/dV by float32
  atomics.
  parts ('kv_outer' and 'tiles'): 'dq' or 'dkv' runs that kernel alone (the
  others come back None), so a benchmark can time each. dkv_prefetch,
  dkv_parts: kv_outer.dkv's prefetch and key_parts.
  """
  tiles_dq = gpu_kernels == 'tiles'
  if tiles_dq:
    gpu_kernels = 'kv_outer'
  if parts not in ('all', 'dq', 'dkv'):
    raise ValueError(f"parts must be 'all', 'dq' or 'dkv', got {parts!r}.")
  if parts != 'all' and (backend != 'gpu' or gpu_kernels != 'kv_outer'):
    raise ValueError("parts='dq' / 'dkv' is for the GPU's KV-outer kernels.")
  b, t, h, d = q_BTHD.shape
  s, g = k_BSGD.shape[1:3]
  r = h // g
  scale = 1.0 / math.sqrt(d)
  sp = kc.round_up(s, block_size)
  valid = _valid_mask(valid_BS, b, s, sp)
  # delta - dlse: a cotangent on the LSE output enters exactly here, since
  # d lse / d s = p.
  delta_BTH = jnp.sum(dout_BTHD.astype(jnp.float32) *
                      out_BTHD.astype(jnp.float32), axis=-1)
  if dlse_BTH is not None:
    delta_BTH = delta_BTH - dlse_BTH.astype(jnp.float32)
  dout = dout_BTHD.astype(q_BTHD.dtype)
  if backend == 'tpu':
    tq = tpu_q_tile(t)
    tp = kc.round_up(t, tq)
    rows = lambda x: _pad_axis(x.reshape(b, t, g, r).transpose(0, 2, 1, 3), 2,
                               tp)
    dq, dk, dv = backward_kernel.backward_tpu(
        _to_group_major_q(q_BTHD, g, tp), _to_group_major_kv(k_BSGD, sp),
        _to_group_major_kv(v_BSGD, sp), _pad_axis(sel_BGTK, 2, tp, -1), off_B,
        valid, _to_group_major_q(dout, g, tp), rows(lse_BTH), rows(delta_BTH),
        block_size=block_size, n_heads=r, q_tile=tq, scale=scale,
        interpret=interpret)
    return (_from_group_major_q(dq, t, h),
            dk.transpose(0, 2, 1, 3)[:, :s], dv.transpose(0, 2, 1, 3)[:, :s])
  _check_gpu_kernels(gpu_kernels)
  rp, dp, kp = _gpu_dims(r, d, sel_BGTK.shape[-1])
  rows = lambda x, rp: _pad_axis(x.reshape(b, t, g, r), 3, rp)
  k_p = _pad_axis(_pad_axis(k_BSGD, 1, sp), 3, dp)
  v_p = _pad_axis(_pad_axis(v_BSGD, 1, sp), 3, dp)
  dq = dk = dv = None
  if parts != 'dkv' and tiles_dq:
    rt = kc.next_pow2(r)
    dq = backward_kernel.dq_gpu_tiles(
        _to_gpu_q(q_BTHD, g, rt, dp), k_p, v_p,
        _pad_axis(sel_BGTK, 3, kp, -1), off_B, valid,
        _to_gpu_q(dout, g, rt, dp), rows(lse_BTH, rt), rows(delta_BTH, rt),
        block_size=block_size, scale=scale, interpret=interpret)
  elif parts != 'dkv':
    out = backward_kernel.backward_gpu(
        _to_gpu_q(q_BTHD, g, rp, dp), k_p, v_p,
        _pad_axis(sel_BGTK, 3, kp, -1), off_B, valid,
        _to_gpu_q(dout, g, rp, dp), rows(lse_BTH, rp), rows(delta_BTH, rp),
        block_size=block_size, scale=scale, interpret=interpret,
        with_dkv=gpu_kernels == 'token')
    dq, dk, dv = out if gpu_kernels == 'token' else (out, None, None)
  if gpu_kernels == 'kv_outer' and parts != 'dq':
    rk = _kv_outer_heads(r, t)
    dk, dv = kv_outer.dkv(
        _to_gpu_q(q_BTHD, g, rk, dp), k_p, v_p, sel_BGTK, off_B, valid,
        _to_gpu_q(dout, g, rk, dp), rows(lse_BTH, rk), rows(delta_BTH, rk),
        block_size=block_size, scale=scale, interpret=interpret,
        prefetch=dkv_prefetch, key_parts=dkv_parts)
  return (None if dq is None else dq[:, :, :, :r, :d].reshape(b, t, h, d),
          None if dk is None else dk[:, :s, :, :d].astype(k_BSGD.dtype),
          None if dv is None else dv[:, :s, :, :d].astype(v_BSGD.dtype))


def sparse_attention(q_BTHD, k_BSGD, v_BSGD, sel_BGTK, off_B, block_size,
                     backend, interpret, kv_valid_BS=None,
                     gpu_kernels='kv_outer', kv_config=None):
  """Main branch on the kernels: (out_BTHD, lse_BTH), differentiable.

  kv_valid_BS: bool [B, S], False at padding keys (None: all valid).
  gpu_kernels: see sparse_forward / sparse_backward. kv_config: the
  KV-outer forward's knobs (kv_outer.ForwardConfig; the backward's kernels
  are the same whatever it is).
  """
  b, s = k_BSGD.shape[:2]
  valid = (jnp.ones((b, s), jnp.int32) if kv_valid_BS is None
           else jnp.asarray(kv_valid_BS).astype(jnp.int32))
  return _sparse_attention(q_BTHD, k_BSGD, v_BSGD, sel_BGTK, off_B, valid,
                           block_size, backend, interpret, gpu_kernels,
                           kv_config)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _sparse_attention(q_BTHD, k_BSGD, v_BSGD, sel_BGTK, off_B, valid_BS,
                      block_size, backend, interpret, gpu_kernels, kv_config):
  return sparse_forward(q_BTHD, k_BSGD, v_BSGD, sel_BGTK, off_B, valid_BS,
                        block_size=block_size, backend=backend,
                        interpret=interpret, gpu_kernels=gpu_kernels,
                        kv_config=kv_config)


def _sparse_attention_fwd(q, k, v, sel, off, valid, block_size, backend,
                          interpret, gpu_kernels, kv_config):
  out, lse = sparse_forward(q, k, v, sel, off, valid, block_size=block_size,
                            backend=backend, interpret=interpret,
                            gpu_kernels=gpu_kernels, kv_config=kv_config)
  return (out, lse), (q, k, v, sel, off, valid, out, lse)


def _sparse_attention_bwd(block_size, backend, interpret, gpu_kernels,
                          kv_config, res, cts):
  del kv_config  # the forward's knobs only
  q, k, v, sel, off, valid, out, lse = res
  dout, dlse = cts
  dq, dk, dv = sparse_backward(q, k, v, sel, off, valid, out, lse, dout, dlse,
                               block_size=block_size, backend=backend,
                               interpret=interpret, gpu_kernels=gpu_kernels)
  return dq, dk, dv, None, None, None


_sparse_attention.defvjp(_sparse_attention_fwd, _sparse_attention_bwd)


# ----------------------------------------------------------------------------
# End to end


def msa_attention(q_BTHD, k_BSGD, v_BSGD, qi_BTGI, ki_BSI, *, block_size,
                  top_k, q_offset, backend, interpret, kv_valid_BS=None,
                  gpu_kernels='kv_outer', topk='pallas', kv_config=None,
                  fp8_scores=False, scores_kernel='triton'):
  """Kernel (a) then kernels (b)/(c): (out_BTHD, {'sel_BGTK', 'lse_BTH'}).

  gpu_kernels: on the GPU backend, 'kv_outer' (two-launch selection,
  kv_outer.py), 'token' (the fused selection and per-token kernels) or
  'tiles' (two-launch selection, then union tiles for the forward and dQ,
  KV-outer dK/dV).
  topk ('pallas' / 'xla'), fp8_scores, scores_kernel ('triton' /
  'mosaic': index_kernel.select_blocks_BGTK) and kv_config
  (kv_outer.ForwardConfig) pick the GPU variants benchmark_gpu times.
  """
  check_block_size(block_size, backend)
  b = q_BTHD.shape[0]
  off_B = jnp.full((b,), q_offset, jnp.int32)
  sel = select_kernel.select_blocks_BGTK(
      jax.lax.stop_gradient(qi_BTGI), jax.lax.stop_gradient(ki_BSI), off_B,
      block_size=block_size, top_k=top_k, backend=backend, interpret=interpret,
      kv_valid_BS=kv_valid_BS, gpu_method=_selector(gpu_kernels), topk=topk,
      fp8_scores=fp8_scores, scores_kernel=scores_kernel)
  out, lse = sparse_attention(q_BTHD, k_BSGD, v_BSGD, sel, off_B, block_size,
                              backend, interpret, kv_valid_BS, gpu_kernels,
                              kv_config)
  return out, {'sel_BGTK': sel, 'lse_BTH': lse}


def decode_cache_len(length: int, block_size: int, backend: str) -> int:
  """The least cache length >= `length` that msa_decode reads in place.

  Every decode step hands the whole cache to the kernels, and a length they
  would pad (K/V to whole blocks; on the GPU the index keys to whole score
  spans, `index_kernel.key_span`; on the TPU to whole selection chunks) is
  a copy of the cache per step and layer. Decode is causal (slots past a
  row's length are never read), so a cache allocated this long costs only
  the unused slots' memory.
  """
  if length < 1:
    raise ValueError(f'length must be >= 1, got {length}.')
  if backend == 'tpu':
    return kc.round_up(length, block_size * select_kernel.CHUNK_BLOCKS)
  if backend != 'gpu':
    raise ValueError(f"backend must be 'tpu' or 'gpu', got {backend!r}.")
  # The span grows with the length (more blocks, up to its cap), so round
  # until the length is a whole number of its own spans.
  s = kc.round_up(length, block_size)
  while s % (span := index_kernel.key_span(s, block_size)):
    s = kc.round_up(s, span)
  return s


def msa_decode(q_BHD, k_cache_BSGD, v_cache_BSGD, qi_BGI, ki_cache_BSI,
               lengths_B, *, block_size, top_k, backend, interpret,
               kv_valid_BS=None, gpu_kernels='kv_outer', topk='pallas',
               kv_config=None):
  """Kernel (a) at T = 1 then kernel (d): (out_BHD, {'sel_BGK', 'lse_BH'}).

  GPU: kernel (d) is the KV-outer forward at one query, split-K (a program
  per sequence, group and slot, then the log-sum-exp combine), after the
  two-launch selection; with gpu_kernels='token' the fused selection and
  the per-token forward. topk, kv_config: as in msa_attention.
  """
  check_block_size(block_size, backend)
  b, h, d = q_BHD.shape
  s, g = k_cache_BSGD.shape[1:3]
  off_B = lengths_B.astype(jnp.int32) - 1
  sel = select_kernel.select_blocks_BGTK(
      qi_BGI[:, None], ki_cache_BSI, off_B, block_size=block_size,
      top_k=top_k, backend=backend, interpret=interpret,
      kv_valid_BS=kv_valid_BS, gpu_method=_selector(gpu_kernels),
      topk=topk)[:, :, 0]
  if backend == 'tpu':
    sp = kc.round_up(s, block_size)
    out, lse = decode_kernel.decode_tpu(
        q_BHD.reshape(b, g, h // g, d), _pad_axis(k_cache_BSGD, 1, sp),
        _pad_axis(v_cache_BSGD, 1, sp), sel, off_B + 1,
        _valid_mask(kv_valid_BS, b, s, sp), block_size=block_size, scale=1.0 / math.sqrt(d), interpret=interpret)
    return out.reshape(b, h, d), {'sel_BGK': sel, 'lse_BH': lse.reshape(b, h)}
  out, lse = sparse_forward(q_BHD[:, None], k_cache_BSGD, v_cache_BSGD,
                            sel[:, :, None], off_B, kv_valid_BS,
                            block_size=block_size, backend=backend,
                            interpret=interpret, gpu_kernels=gpu_kernels,
                            kv_config=kv_config)
  return out[:, 0], {'sel_BGK': sel, 'lse_BH': lse[:, 0]}
