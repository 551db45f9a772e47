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
from pallas_kernels.msa import index_kernel
from pallas_kernels.msa import kv_outer
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


@pytest.mark.parametrize('gpu_method', ['two_pass', 'fused'])
@pytest.mark.parametrize('name', sorted(GPU_SHAPES))
def test_selection_kernel_matches_reference(name, gpu_method):
  # f32 index inputs: the two-pass kernel's dots are tf32x3, the fused
  # kernel's IEEE f32.
  b, t, s, g, r, d, di, c, k, o = GPU_SHAPES[name]
  _, _, _, qi, ki, _ = lib.make_inputs(b, t, s, g, r, d, di)
  sel = jax.jit(functools.partial(
      select_kernel.select_blocks_BGTK, block_size=c, top_k=k, backend='gpu',
      interpret=False, gpu_method=gpu_method))(
          qi, ki, jnp.full((b,), o, jnp.int32))
  want = jax.jit(functools.partial(ref.selection_BGTK, block_size=c, top_k=k,
                                   q_offset=o))(qi, ki)
  np.testing.assert_array_equal(lib.as_sets(sel), lib.as_sets(want))
  if t <= 128:  # the invariant check loops in Python over every row
    lib.check_selection_invariants(sel, c, o)


@pytest.mark.parametrize('name', sorted(GPU_SHAPES))
def test_bf16_index_on_exact_inputs_equals_reference_slot_for_slot(name):
  # Scores exact in bf16 products and f32 sums: tensor-core summation order
  # cannot matter, and the many ties check the lower-id rule.
  b, t, s, g, r, d, di, c, k, o = GPU_SHAPES[name]
  qi, ki = lib.exact_index_inputs(b, t, s, g, di, seed=1)
  sel = jax.jit(functools.partial(
      select_kernel.select_blocks_BGTK, block_size=c, top_k=k, backend='gpu',
      interpret=False))(qi, ki, jnp.full((b,), o, jnp.int32))
  want = jax.jit(functools.partial(ref.selection_BGTK, block_size=c, top_k=k,
                                   q_offset=o))(qi.astype(jnp.float32),
                                                ki.astype(jnp.float32))
  np.testing.assert_array_equal(np.asarray(sel), np.asarray(want))


@pytest.mark.parametrize('name', sorted(GPU_SHAPES))
def test_mosaic_score_launch_on_exact_inputs_equals_reference(name):
  # index_mosaic.py compiled by Mosaic GPU (TMA, wgmma): the same slots as
  # the reference, and the same block scores as the Triton launch.
  b, t, s, g, r, d, di, c, k, o = GPU_SHAPES[name]
  qi, ki = lib.exact_index_inputs(b, t, s, g, di, seed=1)
  off = jnp.full((b,), o, jnp.int32)
  sel = jax.jit(functools.partial(
      index_kernel.select_blocks_BGTK, block_size=c, top_k=k,
      interpret=False, scores_kernel='mosaic'))(qi, ki, off)
  want = jax.jit(functools.partial(ref.selection_BGTK, block_size=c, top_k=k,
                                   q_offset=o))(qi.astype(jnp.float32),
                                                ki.astype(jnp.float32))
  np.testing.assert_array_equal(np.asarray(sel), np.asarray(want))
  scores = {kernel: np.concatenate([np.asarray(x) for x in jax.jit(
      functools.partial(index_kernel.index_scores, block_size=c,
                        interpret=False, kernel=kernel))(qi, ki, off)], 2)
            for kernel in ('mosaic', 'triton')}
  rows = t * g
  np.testing.assert_array_equal(scores['mosaic'][..., :rows],
                                scores['triton'][..., :rows])


def test_bf16_index_on_random_inputs_keeps_the_margin_rule():
  b, t, s, g, r, d, di, c, k, o = GPU_SHAPES['real_heads_2k']
  _, _, _, qi, ki, _ = lib.make_inputs(b, t, s, g, r, d, di, seed=2)
  sel = jax.jit(functools.partial(
      select_kernel.select_blocks_BGTK, block_size=c, top_k=k, backend='gpu',
      interpret=False))(qi.astype(jnp.bfloat16), ki.astype(jnp.bfloat16),
                        jnp.full((b,), o, jnp.int32))
  scores = jax.jit(lambda qi, ki: ref.block_scores_BGTN(
      ref.index_logits_BGTS(qi, ki, o), c))(qi, ki)
  violations, flip_rate = lib.selection_margin_report(sel, scores, qi, ki, c,
                                                      k, o)
  print(f'bf16 index on the GPU: flip rate {flip_rate:.4f}')
  assert violations == 0


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
  # Index inputs in the model's dtype. The selection is judged by the margin
  # rule, and the main branch on the kernel's own selection.
  b, t, s, g, r, d, di, c, k, o = GPU_SHAPES['real_heads_chunk']
  q, kk, v, qi, ki, _ = lib.make_inputs(b, t, s, g, r, d, di, dtype=dtype)
  qi_x, ki_x = qi.astype(dtype), ki.astype(dtype)
  out, aux = jax.jit(functools.partial(
      pallas_path.msa_attention, block_size=c, top_k=k, q_offset=o,
      backend='gpu', interpret=False))(q, kk, v, qi_x, ki_x)
  sel = aux['sel_BGTK']
  scores = jax.jit(lambda qi, ki: ref.block_scores_BGTN(
      ref.index_logits_BGTS(qi, ki, o), c))(qi, ki)
  assert lib.selection_margin_report(sel, scores, qi, ki, c, k, o)[0] == 0
  f32 = lambda x: x.astype(jnp.float32)
  want, _ = jax.jit(functools.partial(
      ref.sparse_attention, block_size=c, q_offset=o))(f32(q), f32(kk),
                                                       f32(v), sel)
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


def test_backward_is_deterministic():
  # KV-outer dK/dV and per-token dQ: no atomics, so the same bits twice.
  b, t, s, g, r, d, di, c, k, o = GPU_SHAPES['real_heads_2k']
  q, kk, v, qi, ki, w = lib.make_inputs(b, t, s, g, r, d, di,
                                        dtype=jnp.bfloat16)
  sel = jax.jit(functools.partial(ref.selection_BGTK, block_size=c, top_k=k,
                                  q_offset=o))(qi, ki)
  off = jnp.full((b,), o, jnp.int32)
  kern = lambda q, k, v: pallas_path.sparse_attention(q, k, v, sel, off, c,
                                                      'gpu', False)
  grad = jax.jit(jax.grad(_loss(kern, w), argnums=(0, 1, 2)))
  first, second = grad(q, kk, v), grad(q, kk, v)
  for name, a, e in zip('qkv', first, second):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e), err_msg=name)


def _bf16_forward_case(name, seed=0):
  """(q, k, v in bf16, the reference selection, offsets, block size, the
  f32 reference's (out, lse)) at GPU_SHAPES[name]."""
  b, t, s, g, r, d, di, c, k, o = GPU_SHAPES[name]
  q, kk, v, qi, ki, _ = lib.make_inputs(b, t, s, g, r, d, di, seed=seed)
  q, kk, v = (x.astype(jnp.bfloat16) for x in (q, kk, v))
  sel = ref.selection_BGTK(qi, ki, block_size=c, top_k=k, q_offset=o)
  f32 = lambda x: x.astype(jnp.float32)
  want = jax.jit(functools.partial(ref.sparse_attention, block_size=c,
                                   q_offset=o))(f32(q), f32(kk), f32(v), sel)
  return q, kk, v, sel, jnp.full((b,), o, jnp.int32), c, want


@pytest.mark.parametrize('name', ['ragged_chunk', 'real_heads_2k'])
def test_tuned_forward_variants_match_reference(name):
  # What the bench's tune phase times must be right first (it also checks
  # each against the default before it counts one's time).
  from pallas_kernels.msa import benchmark_gpu  # pylint: disable=g-import-not-at-top
  q, kk, v, sel, off, c, want = _bf16_forward_case(name)
  # The first few (the bench's first group) and every one that changes
  # the tiling; the bench checks the rest against the default itself.
  configs = [c for i, c in enumerate(benchmark_gpu.TUNE)
             if i < 3 or c.q_per_tile or c.query_chunk]
  for config in configs:
    got = jax.jit(lambda q, k_, v_, sel: pallas_path.sparse_forward(
        q, k_, v_, sel, off, None, block_size=c, backend='gpu',
        interpret=False, kv_config=config))(q, kk, v, sel)
    lib.assert_close(got[0], want[0], 2e-2, f'out {config.label()}')
    lib.assert_close(got[1], want[1], 2e-2, f'lse {config.label()}')


@pytest.mark.parametrize('name', ['real_heads_2k', 'real_heads_chunk'])
def test_mosaic_forward_matches_reference_and_triton(name):
  # kv_outer_mosaic.py compiled by Mosaic GPU (TMA gathers, wgmma), with
  # XLA's merge and the fused one: the reference's output and LSE, and the
  # Triton forward's to bf16 rounding (P rounds alike; sums may not).
  q, kk, v, sel, off, c, want = _bf16_forward_case(name, seed=3)
  run = lambda cfg: jax.jit(lambda q, k_, v_, sel: pallas_path.sparse_forward(
      q, k_, v_, sel, off, None, block_size=c, backend='gpu',
      interpret=False, kv_config=cfg))(q, kk, v, sel)
  triton = run(kv_outer.ForwardConfig(pair_order=True))
  for fused in (False, True):
    got = run(kv_outer.ForwardConfig(pair_order=True, kernel='mosaic',
                                     fused_combine=fused))
    lib.assert_close(got[0], want[0], 2e-2, f'out fused={fused}')
    lib.assert_close(got[1], want[1], 2e-2, f'lse fused={fused}')
    lib.assert_close(got[0], triton[0], 2e-2, f'vs triton fused={fused}')


def test_xla_topk_selection_equals_the_pallas_topk_in_decode():
  b, s, g, di, c, k = 8, 32768, 4, 128, 128, 16
  _, _, _, qi, ki, _ = lib.make_inputs(b, 1, s, g, 1, 16, di, seed=5)
  qi, ki = qi.astype(jnp.bfloat16), ki.astype(jnp.bfloat16)
  off = jnp.array([s - 1, 4000, 129, 127, 20000, s - 1, 9999, 1],
                  jnp.int32)
  run = lambda topk: jax.jit(functools.partial(
      select_kernel.select_blocks_BGTK, block_size=c, top_k=k, backend='gpu',
      interpret=False, topk=topk))(qi, ki, off)
  # Same scores, same tie rule: the same selection slot for slot.
  np.testing.assert_array_equal(np.asarray(run('xla')),
                                np.asarray(run('pallas')))


def test_fp8_index_scores_on_the_gpu():
  # e4m3 tensor-core dots (Hopper accumulates them in fewer bits than f32):
  # exact on exact inputs, within the coarse margin rule on random ones.
  b, t, s, g, r, d, di, c, k, o = GPU_SHAPES['real_heads_2k']
  select = jax.jit(functools.partial(
      select_kernel.select_blocks_BGTK, block_size=c, top_k=k, backend='gpu',
      interpret=False, fp8_scores=True))
  off = jnp.full((b,), o, jnp.int32)
  qi, ki = lib.exact_index_inputs(b, t, s, g, di, seed=1)
  want = jax.jit(functools.partial(ref.selection_BGTK, block_size=c, top_k=k,
                                   q_offset=o))(qi.astype(jnp.float32),
                                                ki.astype(jnp.float32))
  np.testing.assert_array_equal(np.asarray(select(qi, ki, off)),
                                np.asarray(want))
  _, _, _, qi, ki, _ = lib.make_inputs(b, t, s, g, r, d, di, seed=2)
  sel = select(qi.astype(jnp.bfloat16), ki.astype(jnp.bfloat16), off)
  scores = jax.jit(lambda qi, ki: ref.block_scores_BGTN(
      ref.index_logits_BGTS(qi, ki, o), c))(qi, ki)
  violations, flip_rate = lib.selection_margin_report(
      sel, scores, qi, ki, c, k, o, eps_scale=2.0**-3)
  print(f'fp8 index on the GPU: flip rate {flip_rate:.4f}')
  assert violations == 0
