"""The MSA Pallas kernels compiled for an NVIDIA GPU (Triton, not interpret).

Run by `make gpu-check`; skipped without a GPU (tests/conftest.py). The same
checks as test_msa_kernels.py, at the real head shapes (D = dI = 128, block
128, top-k 16) and at a small ragged shape that exercises every padding path
(R, D, K not powers of two, S not a multiple of the block, chunk offset).
The reference runs on the GPU too, in f32 with Precision.HIGHEST (the dense
[T, S] logits bound T to a few thousand). bf16 kernels are compared with the
reference on the same bf16 values upcast to f32.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import msa_testlib as lib
from pallas_kernels.msa import pallas_path
from pallas_kernels.msa import reference as ref
from pallas_kernels.msa import select_kernel

pytestmark = pytest.mark.gpu

# (b, t, s, g, r, d, di, block, top_k, q_offset)
GPU_SHAPES = {
    'ragged_chunk': lib.SHAPES['ragged_chunk'],
    'real_heads_2k': (1, 2048, 2048, 2, 16, 128, 128, 128, 8, 0),
    'real_heads_chunk': (1, 1024, 3072, 1, 8, 128, 128, 128, 16, 2048),
}
DTYPES = [(jnp.float32, 1e-4), (jnp.bfloat16, 2e-2)]


@pytest.mark.parametrize('name', sorted(GPU_SHAPES))
def test_selection_kernel_matches_reference(name):
  b, t, s, g, r, d, di, c, k, o = GPU_SHAPES[name]
  _, _, _, qi, ki, _ = lib.make_inputs(b, t, s, g, r, d, di)
  sel = jax.jit(functools.partial(
      select_kernel.select_blocks_BGTK, block_size=c, top_k=k, backend='gpu',
      interpret=False))(qi, ki, jnp.full((b,), o, jnp.int32))
  want = jax.jit(functools.partial(ref.selection_BGTK, block_size=c, top_k=k,
                                   q_offset=o))(qi, ki)
  np.testing.assert_array_equal(lib.as_sets(sel), lib.as_sets(want))
  if t <= 128:  # the invariant check loops in Python over every row
    lib.check_selection_invariants(sel, c, o)


def _loss(attn, w):
  def loss(q, k, v):
    out, lse = attn(q, k, v)
    return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(jnp.sin(lse))
  return loss


@pytest.mark.parametrize('dtype,tol', DTYPES)
@pytest.mark.parametrize('name', sorted(GPU_SHAPES))
def test_forward_and_gradients_match_reference(name, dtype, tol):
  b, t, s, g, r, d, di, c, k, o = GPU_SHAPES[name]
  q, kk, v, qi, ki, w = lib.make_inputs(b, t, s, g, r, d, di, dtype=dtype)
  sel = jax.jit(functools.partial(ref.selection_BGTK, block_size=c, top_k=k,
                                  q_offset=o))(qi, ki)
  off = jnp.full((b,), o, jnp.int32)
  kern = lambda q, k, v: pallas_path.sparse_attention(q, k, v, sel, off, c,
                                                      'gpu', False)
  slow = functools.partial(ref.sparse_attention, sel_BGTK=sel, block_size=c,
                           q_offset=o)
  f32 = lambda *xs: [x.astype(jnp.float32) for x in xs]
  got = jax.jit(kern)(q, kk, v)
  want = jax.jit(slow)(*f32(q, kk, v))
  assert got[0].dtype == dtype
  lib.assert_close(got[0], want[0], tol, 'out')
  lib.assert_close(got[1], want[1], tol, 'lse')
  g_got = jax.jit(jax.grad(_loss(kern, w), argnums=(0, 1, 2)))(q, kk, v)
  g_want = jax.jit(jax.grad(_loss(slow, w), argnums=(0, 1, 2)))(
      *f32(q, kk, v))
  for name_, a, e in zip('qkv', g_got, g_want):
    assert a.dtype == dtype, (name_, a.dtype)
    lib.assert_close(a, e, tol, f'd{name_}')


@pytest.mark.parametrize('dtype,tol', DTYPES)
def test_end_to_end_matches_reference(dtype, tol):
  b, t, s, g, r, d, di, c, k, o = GPU_SHAPES['real_heads_chunk']
  q, kk, v, qi, ki, _ = lib.make_inputs(b, t, s, g, r, d, di, dtype=dtype)
  out, aux = jax.jit(functools.partial(
      pallas_path.msa_attention, block_size=c, top_k=k, q_offset=o,
      backend='gpu', interpret=False))(q, kk, v, qi, ki)
  want, want_aux = jax.jit(functools.partial(
      ref.msa_attention, block_size=c, top_k=k, q_offset=o))(
          q.astype(jnp.float32), kk.astype(jnp.float32),
          v.astype(jnp.float32), qi, ki)
  np.testing.assert_array_equal(lib.as_sets(aux['sel_BGTK']),
                                lib.as_sets(want_aux['sel_BGTK']))
  lib.assert_close(out, want, tol, 'out')


@pytest.mark.parametrize('dtype,tol', DTYPES)
@pytest.mark.parametrize('shape', [(2, 80, 2, 2, 128, 8, 16, 3),
                                   (2, 4096, 2, 16, 128, 128, 128, 16)])
def test_decode_equals_last_row_of_prefill(shape, dtype, tol):
  b, s, g, r, d, di, c, k = shape
  q, kk, v, qi, ki, _ = lib.make_inputs(b, 1, s, g, r, d, di, dtype=dtype)
  lengths = jnp.array([s, s // 2 - 37])
  out, aux = jax.jit(functools.partial(
      pallas_path.msa_decode, block_size=c, top_k=k, backend='gpu',
      interpret=False))(q[:, 0], kk, v, qi[:, 0], ki, lengths)
  want, want_aux = jax.jit(functools.partial(
      ref.msa_attention, block_size=c, top_k=k))(
          q.astype(jnp.float32), kk.astype(jnp.float32),
          v.astype(jnp.float32), qi, ki, q_offset=lengths - 1)
  np.testing.assert_array_equal(aux['sel_BGK'], want_aux['sel_BGTK'][:, :, 0])
  lib.assert_close(out, want[:, 0], tol, 'out')
  lib.assert_close(aux['lse_BH'], want_aux['lse_BTH'][:, 0], tol, 'lse')
