"""The Pallas kernels (interpret=True on CPU) against the reference.

Both lowerings run: 'tpu' (Mosaic grid with scalar prefetch) and 'gpu'
(Triton-style per-token programs). Shapes stay small: interpret mode executes
the grid step by step. The lowering tests compile nothing; they check that
Mosaic and Triton accept the kernels for real device shapes.
"""
import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import msa_testlib as lib
from pallas_kernels.msa import pallas_path
from pallas_kernels.msa import reference as ref
from pallas_kernels.msa import select_kernel

BACKENDS = ['tpu', 'gpu']


# The GPU backend's default selector is the two-launch one
# (test_msa_index_kernel.py); its fused running-table kernel stays as the
# oracle and is checked here too.
@pytest.mark.parametrize('backend,gpu_method', [
    ('tpu', 'two_pass'), ('gpu', 'two_pass'), ('gpu', 'fused')])
@pytest.mark.parametrize('name', sorted(lib.SHAPES))
def test_selection_kernel_matches_reference(backend, gpu_method, name):
  b, t, s, g, r, d, di, c, k, o = lib.SHAPES[name]
  _, _, _, qi, ki, _ = lib.make_inputs(b, t, s, g, r, d, di)
  sel = jax.jit(functools.partial(
      select_kernel.select_blocks_BGTK, block_size=c, top_k=k,
      backend=backend, interpret=True, gpu_method=gpu_method))(
          qi, ki, jnp.full((b,), o, jnp.int32))
  want = ref.selection_BGTK(qi, ki, block_size=c, top_k=k, q_offset=o)
  np.testing.assert_array_equal(lib.as_sets(sel), lib.as_sets(want))
  lib.check_selection_invariants(sel, c, o)


@pytest.mark.parametrize('backend,gpu_method', [('tpu', 'two_pass'),
                                                ('gpu', 'fused')])
def test_selection_kernels_take_bf16_keys_as_they_are(backend, gpu_method):
  # bf16 index keys reach the kernels uncast (each tile is cast to f32
  # inside, exactly), so a decode cache is never recast whole; on inputs
  # whose dots are exact, the slots are the brute force's.
  b, t, s, g, di, c, k, o = 2, 24, 100, 2, 8, 16, 4, 60
  qi, ki = lib.exact_index_inputs(b, t, s, g, di, seed=4)
  sel = jax.jit(functools.partial(
      select_kernel.select_blocks_BGTK, block_size=c, top_k=k,
      backend=backend, interpret=True, gpu_method=gpu_method))(
          qi, ki, jnp.full((b,), o, jnp.int32))
  f32 = lambda x: x.astype(jnp.float32)
  want = np.stack([lib.brute_force_selection(f32(qi[i:i + 1]),
                                             f32(ki[i:i + 1]), c, k, o)[0]
                   for i in range(b)])
  np.testing.assert_array_equal(np.asarray(sel), want)


def _grads(attn, w, q, k, v):
  def loss(q, k, v):
    out, lse = attn(q, k, v)
    return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(jnp.sin(lse))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.parametrize('backend', BACKENDS)
@pytest.mark.parametrize('dtype,tol', [(jnp.float32, 1e-5),
                                       (jnp.bfloat16, 2e-2)])
def test_forward_and_gradients_match_reference(backend, dtype, tol):
  b, t, s, g, r, d, di, c, k, o = lib.SHAPES['ragged_chunk']
  q, kk, v, qi, ki, w = lib.make_inputs(b, t, s, g, r, d, di, dtype=dtype)
  sel = ref.selection_BGTK(qi, ki, block_size=c, top_k=k, q_offset=o)
  off = jnp.full((b,), o, jnp.int32)
  kern = lambda q, k, v: pallas_path.sparse_attention(q, k, v, sel, off, c,
                                                      backend, True)
  slow = functools.partial(ref.sparse_attention, sel_BGTK=sel, block_size=c,
                           q_offset=o)
  got, want = jax.jit(kern)(q, kk, v), slow(q, kk, v)
  lib.assert_close(got[0], want[0], tol, 'out')
  lib.assert_close(got[1], want[1], tol, 'lse')
  for name, a, e in zip('qkv', _grads(kern, w, q, kk, v),
                        _grads(slow, w, q, kk, v)):
    lib.assert_close(a, e, tol, f'd{name}')


@pytest.mark.parametrize('backend', BACKENDS)
def test_end_to_end_with_shuffled_padded_selection(backend):
  b, t, s, g, r, d, di, c, k, o = lib.SHAPES['gqa']
  q, kk, v, qi, ki, _ = lib.make_inputs(b, t, s, g, r, d, di)
  out, aux = jax.jit(functools.partial(
      pallas_path.msa_attention, block_size=c, top_k=k, q_offset=o,
      backend=backend, interpret=True))(q, kk, v, qi, ki)
  want, want_aux = ref.msa_attention(q, kk, v, qi, ki, block_size=c, top_k=k,
                                     q_offset=o)
  np.testing.assert_array_equal(lib.as_sets(aux['sel_BGTK']),
                                lib.as_sets(want_aux['sel_BGTK']))
  lib.assert_close(out, want, 1e-5, 'out')
  sel = aux['sel_BGTK']
  perm = np.random.default_rng(2).permutation(k)
  shuffled = jnp.concatenate([sel[..., perm], -jnp.ones_like(sel[..., :1])], -1)
  off = jnp.full((b,), o, jnp.int32)
  z, _ = jax.jit(lambda *a: pallas_path.sparse_attention(
      *a, c, backend, True))(q, kk, v, shuffled, off)
  lib.assert_close(z, out, 1e-6, 'shuffled')


@pytest.mark.parametrize('backend', BACKENDS)
def test_full_budget_equals_dense_causal_gqa(backend):
  b, t, s, g, r, d, di, c, o = 1, 24, 40, 2, 2, 16, 8, 16, 16
  q, kk, v, qi, ki, _ = lib.make_inputs(b, t, s, g, r, d, di)
  out, _ = jax.jit(functools.partial(
      pallas_path.msa_attention, block_size=c, top_k=-(-s // c) + 1,
      q_offset=o, backend=backend, interpret=True))(q, kk, v, qi, ki)
  lib.assert_close(out, ref.dense_causal_attention(q, kk, v, o), 1e-5)


@pytest.mark.parametrize('backend', BACKENDS)
def test_decode_equals_last_row_of_prefill(backend):
  # d = 128 takes the TPU kernel's in-place cache path ([B, S, G*D] view).
  b, s, g, r, d, di, c, k = 2, 80, 2, 2, 128, 8, 16, 3
  q, kk, v, qi, ki, _ = lib.make_inputs(b, 1, s, g, r, d, di)
  lengths = jnp.array([80, 37])
  out, aux = jax.jit(functools.partial(
      pallas_path.msa_decode, block_size=c, top_k=k, backend=backend,
      interpret=True))(q[:, 0], kk, v, qi[:, 0], ki, lengths)
  want, want_aux = ref.msa_attention(q, kk, v, qi, ki, block_size=c, top_k=k,
                                     q_offset=lengths - 1)
  lib.assert_close(out, want[:, 0], 1e-5, 'out')
  lib.assert_close(aux['lse_BH'], want_aux['lse_BTH'][:, 0], 1e-5, 'lse')
  np.testing.assert_array_equal(aux['sel_BGK'], want_aux['sel_BGTK'][:, :, 0])


# ----------------------------------------------------------------------------
# Lowering for real devices (no execution here): Mosaic for TPU, Triton for
# GPU, at a realistic head shape in bf16.


@pytest.mark.parametrize('backend,platform,dtype', [
    ('tpu', 'tpu', jnp.bfloat16), ('gpu', 'cuda', jnp.bfloat16),
    ('gpu', 'cuda', jnp.float32)])
def test_kernels_lower_for_device(backend, platform, dtype):
  # f32 on the GPU lowers its dots to tf32x3 (kernel_common.gpu_precision_for).
  b, t, g, r, d, di, c, k = 1, 256, 2, 4, 128, 128, 64, 4
  bf = dtype
  q = jax.ShapeDtypeStruct((b, t, g * r, d), bf)
  kv = jax.ShapeDtypeStruct((b, t, g, d), bf)
  qi = jax.ShapeDtypeStruct((b, t, g, di), jnp.float32)
  ki = jax.ShapeDtypeStruct((b, t, di), jnp.float32)

  def train_step(q, keys, values, qi, ki):
    def loss(q, keys, values):
      out, _ = pallas_path.msa_attention(q, keys, values, qi, ki, block_size=c,
                                         top_k=k, q_offset=0, backend=backend,
                                         interpret=False)
      return out.astype(jnp.float32).sum()
    return jax.grad(loss, argnums=(0, 1, 2))(q, keys, values)

  decode = functools.partial(pallas_path.msa_decode, block_size=c, top_k=k,
                             backend=backend, interpret=False)
  with (lib.cuda_lowering() if backend == 'gpu'
        else contextlib.nullcontext()):
    text = jax.jit(train_step).trace(q, kv, kv, qi, ki).lower(
        lowering_platforms=(platform,)).as_text()
    # Decode on index keys in the caches' dtype, as the model holds them.
    text += jax.jit(decode).trace(
        jax.ShapeDtypeStruct((b, g * r, d), bf), kv, kv,
        jax.ShapeDtypeStruct((b, g, di), bf),
        jax.ShapeDtypeStruct((b, t, di), bf),
        jax.ShapeDtypeStruct((b,), jnp.int32)).lower(
            lowering_platforms=(platform,)).as_text()
  marker = 'tpu_custom_call' if backend == 'tpu' else 'triton'
  # select, forward, dq + dkv (TPU) or fused backward (GPU), decode.
  assert text.count(marker) >= 4, text[:2000]


# ----------------------------------------------------------------------------
# The decode cache length: what the kernels read in place.


def _decode_cache_ops(backend, gpu_kernels, s, c, dtype):
  """The array operations on the K/V and index-key caches (length s) in one
  traced decode step, outside the kernels."""
  # d = 128: the TPU kernel's in-place cache layout (a [B, S, G*D] view).
  b, g, r, d, di = 2, 2, 2, 128, 32
  kv = jax.ShapeDtypeStruct((b, s, g, d), dtype)
  ki = jax.ShapeDtypeStruct((b, s, di), dtype)
  decode = functools.partial(pallas_path.msa_decode, block_size=c, top_k=3,
                             backend=backend, interpret=False,
                             gpu_kernels=gpu_kernels)
  jaxpr = jax.make_jaxpr(decode)(
      jax.ShapeDtypeStruct((b, g * r, d), dtype), kv, kv,
      jax.ShapeDtypeStruct((b, g, di), dtype), ki,
      jax.ShapeDtypeStruct((b,), jnp.int32),
      kv_valid_BS=jax.ShapeDtypeStruct((b, s), bool))
  # A reshape that merges trailing dims is a view (XLA makes it a bitcast).
  return [op for op in lib.array_ops_on(jaxpr.jaxpr, {(b, s, g, d),
                                                      (b, s, di)})
          if op[0] != 'reshape']


# The GPU's default kernels (two-launch selection, KV-outer split-K), its
# per-token ones (the fused selector) and the TPU's, on bf16 caches.
@pytest.mark.parametrize('backend,gpu_kernels', [
    ('gpu', 'kv_outer'), ('gpu', 'token'), ('tpu', 'kv_outer')])
@pytest.mark.parametrize('dtype', [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize('length', [1, 30, 300, 2100])
def test_decode_cache_len_is_the_least_length_read_in_place(
    backend, gpu_kernels, dtype, length):
  c = 16
  s = pallas_path.decode_cache_len(length, c, backend)
  assert length <= s < length + max(length, 2048)
  ops = functools.partial(_decode_cache_ops, backend, gpu_kernels, c=c,
                          dtype=dtype)
  # At s no operation outside the kernels touches a cache (no pad, no cast,
  # no transpose), so a decode step reads it in place...
  assert ops(s) == []
  # ... and at a shorter length down to the one asked for (sampled), one
  # pads it: a copy of the cache per step, which the check above would see.
  # (The per-token kernels pad only to whole blocks.)
  for shorter in sorted({length, (length + s) // 2, s - 1} - {s}):
    if shorter >= length and (gpu_kernels == 'kv_outer' or shorter % c):
      assert any(op == 'pad' for op, _ in ops(shorter)), shorter


def test_decode_cache_len_rejects_bad_input():
  with pytest.raises(ValueError, match='length'):
    pallas_path.decode_cache_len(0, 16, 'gpu')
  with pytest.raises(ValueError, match='backend'):
    pallas_path.decode_cache_len(8, 16, 'cpu')
