"""The union-tile GPU kernels (forward_kernel.forward_gpu_tiles,
backward_kernel.dq_gpu_tiles) in interpret mode: their visit lists against
numpy, output, LSE and dq against the dense reference (padding keys, -1
slots, a chunk offset, a length no multiple of the tile), gradients
through the API, and Triton lowering at real shapes (compiles nothing)."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import msa_testlib as lib
from pallas_kernels.msa import backward_kernel
from pallas_kernels.msa import forward_kernel
from pallas_kernels.msa import pallas_path
from pallas_kernels.msa import reference as ref


def test_tile_union_lists_each_tiles_distinct_blocks_ascending():
  rng = np.random.default_rng(0)
  b, g, t, k, n = 2, 3, 24, 4, 10
  sel = rng.integers(0, n, (b, g, t, k))
  sel[:, :, ::3, 1] = -1
  sel[0, 0, :4] = -1  # a tile that selected nothing
  for tq in (1, 4, 8):
    blocks, count = map(np.asarray, forward_kernel.tile_union(
        jnp.asarray(sel, jnp.int32), tq, n))
    u = blocks.shape[-1]
    assert u == pl2(min(n, tq * k))
    for bb in range(b):
      for gg in range(g):
        for i in range(t // tq):
          want = np.unique(sel[bb, gg, i * tq:(i + 1) * tq])
          want = want[want >= 0]
          assert count[bb, gg, i] == len(want)
          np.testing.assert_array_equal(blocks[bb, gg, i, :len(want)], want)


def pl2(x):
  return 1 << (x - 1).bit_length()


def _case(dtype, seed=0):
  # ragged_chunk: T 40 at offset 60, S 100 (not whole blocks), G 2, R 3.
  b, t, s, g, r, d, di, c, k, o = lib.SHAPES['ragged_chunk']
  q, kk, v, qi, ki, w = lib.make_inputs(b, t, s, g, r, d, di, seed=seed,
                                        dtype=dtype)
  valid = np.ones((b, s), bool)
  valid[:, 20:37] = False  # a whole padding block and parts of two
  valid = jnp.asarray(valid)
  sel = np.array(ref.selection_BGTK(qi, ki, block_size=c, top_k=k,
                                    q_offset=o, kv_valid_BS=valid))
  sel[:, :, ::7, 2] = -1  # fewer than K blocks for some tokens
  return (q, kk, v, w, jnp.asarray(sel), valid), (b, t, s, g, r, d, c, k, o)


@pytest.mark.parametrize('dtype,tol', [(jnp.float32, 1e-5),
                                       (jnp.bfloat16, 2e-2)])
def test_tiles_forward_equals_the_reference(dtype, tol):
  (q, kk, v, _, sel, valid), (b, t, s, g, r, d, c, k, o) = _case(dtype)
  f32 = lambda x: x.astype(jnp.float32)
  want = ref.sparse_attention(f32(q), f32(kk), f32(v), sel, block_size=c,
                              q_offset=o, kv_valid_BS=valid)
  rp, dp = 4, 16
  sp = 112
  pad_kv = lambda x: pallas_path._pad_axis(pallas_path._pad_axis(x, 1, sp),
                                           3, dp)
  args = (pallas_path._to_gpu_q(q, g, rp, dp), pad_kv(kk), pad_kv(v),
          sel, jnp.full((b,), o, jnp.int32),
          pallas_path._valid_mask(valid, b, s, sp))
  finite = np.isfinite(np.asarray(want[1]))
  for q_tile in (1, 4, 16, None):  # 40 tokens: tiles of 16 pad the last
    out, lse = jax.jit(functools.partial(
        forward_kernel.forward_gpu_tiles, block_size=c,
        scale=1 / math.sqrt(d), interpret=True, q_tile=q_tile))(*args)
    assert out.dtype == dtype
    lib.assert_close(out[..., :r, :d].reshape(b, t, g * r, d), want[0], tol,
                     f'out q_tile={q_tile}')
    got_lse = lse[..., :r].reshape(b, t, g * r)
    np.testing.assert_array_equal(np.isfinite(np.asarray(got_lse)), finite)
    lib.assert_close(jnp.where(finite, got_lse, 0),
                     jnp.where(finite, want[1], 0), tol, 'lse')
  with pytest.raises(ValueError, match='power of two'):
    forward_kernel.forward_gpu_tiles(*args, block_size=c, scale=1.0,
                                     interpret=True, q_tile=3)


def test_tiles_through_the_api_forward_gradients_and_decode():
  # gpu_kernels='tiles': the union-tile forward and dq, the KV-outer
  # dK/dV; at one query per sequence, split-K decode.
  (q, kk, v, w, sel, valid), (b, t, s, g, r, d, c, k, o) = _case(
      jnp.float32, seed=1)
  off = jnp.full((b,), o, jnp.int32)

  def loss(attn):
    def f(q, k_, v_):
      out, lse = attn(q, k_, v_)
      return jnp.sum(out * w) + jnp.sum(jnp.where(jnp.isfinite(lse),
                                                  jnp.sin(lse), 0.0))
    return f

  kern = lambda q, k_, v_: pallas_path.sparse_attention(
      q, k_, v_, sel, off, c, 'gpu', True, valid, 'tiles')
  slow = lambda q, k_, v_: ref.sparse_attention(
      q, k_, v_, sel, block_size=c, q_offset=o, kv_valid_BS=valid)
  got = jax.jit(jax.value_and_grad(loss(kern), argnums=(0, 1, 2)))(q, kk, v)
  want = jax.value_and_grad(loss(slow), argnums=(0, 1, 2))(q, kk, v)
  lib.assert_close(got[0], want[0], 1e-5, 'loss')
  for name, a, e in zip('qkv', got[1], want[1]):
    lib.assert_close(a, e, 1e-5, f'd{name}')
  qd, kd, vd, qid, kid, _ = lib.make_inputs(2, 1, 100, g, r, d, 8, seed=2)
  dec = lambda kernels: jax.jit(functools.partial(
      pallas_path.msa_decode, block_size=c, top_k=k, backend='gpu',
      interpret=True, gpu_kernels=kernels))(qd[:, 0], kd, vd, qid[:, 0], kid,
                                            jnp.array([100, 37]))
  for a, e in zip(jax.tree.leaves(dec('tiles')),
                  jax.tree.leaves(dec('kv_outer'))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


@pytest.mark.parametrize('dtype,tol', [(jnp.float32, 1e-5),
                                       (jnp.bfloat16, 2e-2)])
def test_tiles_dq_equals_the_reference(dtype, tol):
  # dq of union tiles (any tile size, the last one ragged) against the
  # reference's gradient w.r.t. q, with LSE and delta from the reference.
  (q, kk, v, w, sel, valid), (b, t, s, g, r, d, c, k, o) = _case(dtype,
                                                                 seed=3)
  f32 = lambda x: x.astype(jnp.float32)
  attend = lambda q_: ref.sparse_attention(q_, f32(kk), f32(v), sel,
                                           block_size=c, q_offset=o,
                                           kv_valid_BS=valid)
  (out, lse), vjp = jax.vjp(attend, f32(q))
  (want,) = vjp((w, jnp.zeros_like(lse)))
  rp, dp, sp = 4, 16, 112
  pad_kv = lambda x: pallas_path._pad_axis(pallas_path._pad_axis(x, 1, sp),
                                           3, dp)
  rows = lambda x: pallas_path._pad_axis(x.reshape(b, t, g, r), 3, rp)
  delta = jnp.sum(w * out, -1)
  args = (pallas_path._to_gpu_q(q, g, rp, dp), pad_kv(kk), pad_kv(v), sel,
          jnp.full((b,), o, jnp.int32),
          pallas_path._valid_mask(valid, b, s, sp),
          pallas_path._to_gpu_q(w.astype(dtype), g, rp, dp), rows(lse),
          rows(delta))
  for q_tile in (1, 4, 16, None):
    dq = jax.jit(functools.partial(
        backward_kernel.dq_gpu_tiles, block_size=c, scale=1 / math.sqrt(d),
        interpret=True, q_tile=q_tile))(*args)
    assert dq.dtype == dtype
    lib.assert_close(dq[..., :r, :d].reshape(b, t, g * r, d), want, tol,
                     f'dq q_tile={q_tile}')


@lib.with_cuda_lowering
def test_tiles_forward_lowers_for_cuda():
  b, t, g, r, d, c, k = 1, 2048, 4, 16, 128, 128, 16
  shape = jax.ShapeDtypeStruct
  q = shape((b, t, g * r, d), jnp.bfloat16)
  kv = shape((b, t, g, d), jnp.bfloat16)
  fwd = lambda q, k_, v_, sel, off: pallas_path.sparse_forward(
      q, k_, v_, sel, off, None, block_size=c, backend='gpu',
      interpret=False, gpu_kernels='tiles')
  text = jax.jit(fwd).trace(q, kv, kv, shape((b, g, t, k), jnp.int32),
                            shape((b,), jnp.int32)).lower(
                                lowering_platforms=('cuda',)).as_text()
  assert 'msa_forward_gpu_tiles' in text
  train = lambda q, k_, v_, sel, off: jax.grad(
      lambda q, k_, v_: pallas_path.sparse_attention(
          q, k_, v_, sel, off, c, 'gpu', False, None, 'tiles')[0].astype(
              jnp.float32).sum(), argnums=(0, 1, 2))(q, k_, v_)
  text = jax.jit(train).trace(q, kv, kv, shape((b, g, t, k), jnp.int32),
                              shape((b,), jnp.int32)).lower(
                                  lowering_platforms=('cuda',)).as_text()
  for name in ('msa_forward_gpu_tiles', 'msa_backward_dq_gpu_tiles',
               'msa_kv_outer_dkv'):
    assert name in text, name
  assert 'msa_backward_dq_gpu"' not in text  # not the per-token dq
