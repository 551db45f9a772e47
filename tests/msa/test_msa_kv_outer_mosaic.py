"""The Mosaic GPU KV-outer forward (kv_outer_mosaic.py) in jax's GPU
interpreter.

Its partials merged by the same combine equal the Triton kernel's
pair-order forward, the output bit for bit (both round P to bf16 before
its MMA) and the log-sum-exp to an ulp, and
the dense reference to bf16 rounding, with -1 slots, padding keys, a
chunked-prefill offset, query chunks and blocks split over several work
items, with the interpreter's race detector on; and it lowers for CUDA at
the GPU bench's shapes (Mosaic GPU's layout inference and TMA rules run
here; PTX is made on the GPU).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import msa_testlib as lib
from pallas_kernels.msa import kv_outer
from pallas_kernels.msa import kv_outer_mosaic
from pallas_kernels.msa import mosaic_common
from pallas_kernels.msa import pallas_path
from pallas_kernels.msa import reference as ref

# (b, t, s, g, r, d, di, c, k, q_offset): 6 heads a group pad to 8 (the
# layout's row tile), so a 64-row tile is 8 queries.
SHAPE = (1, 32, 100, 2, 6, 16, 8, 16, 4, 68)


def _case(seed=0):
  b, t, s, g, r, d, di, c, k, o = SHAPE
  q, kk, v, qi, ki, _ = lib.make_inputs(b, t, s, g, r, d, di, seed=seed)
  q, kk, v = (x.astype(jnp.bfloat16) for x in (q, kk, v))
  sel = np.array(ref.selection_BGTK(qi, ki, block_size=c, top_k=k,
                                    q_offset=o))
  sel[:, :, ::5, 0] = -1  # -1 slots: their pairs' rows are never written
  valid = np.ones((b, s), bool)
  valid[:, 20:37] = False  # a whole padding block and part of the next
  return q, kk, v, jnp.asarray(sel), jnp.asarray(valid)


def test_equals_the_triton_forward_and_the_reference(monkeypatch):
  """In jax's GPU interpreter with its happens-before race detector on. jax 0.11's detector finds a
  TMA copy into shared memory that threads may still be reading (it
  caught one in the score launch); it runs TMA stores at once, so the wait
  before o_smem is rewritten rests on the code, not on this test. Two
  query chunks, blocks split into items of 2 tiles, the fused merge."""
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpret  # pylint: disable=g-import-not-at-top
  params = mosaic_common.interpret_params
  monkeypatch.setattr(mosaic_common, 'interpret_params', lambda interpret: (
      type(params(True))(detect_races=True) if interpret else False))
  q, kk, v, sel, valid = _case()
  b, _, _, _, _, _, _, c, _, o = SHAPE
  off = jnp.full((b,), o, jnp.int32)
  knobs = {'query_chunk': 16, 'tiles_per_program': 2, 'fused_combine': True}

  def run(**kw):
    cfg = kv_outer.ForwardConfig(pair_order=True, **{**knobs, **kw})
    return jax.jit(lambda q, k_, v_, sel: pallas_path.sparse_forward(
        q, k_, v_, sel, off, valid, block_size=c, backend='gpu',
        interpret=True, kv_config=cfg))(q, kk, v, sel)

  triton, got = run(q_per_tile=8), run(kernel='mosaic')
  assert not gpu_interpret.get_races().races_found
  # The outputs bit for bit; the log-sum-exps to an ulp (m + log l, scaled
  # in another order).
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(triton[0]))
  np.testing.assert_allclose(np.asarray(got[1]), np.asarray(triton[1]),
                             rtol=1e-6)
  f32 = lambda x: x.astype(jnp.float32)
  want = ref.sparse_attention(f32(q), f32(kk), f32(v), sel, block_size=c,
                              q_offset=o, kv_valid_BS=valid)
  finite = np.isfinite(np.asarray(want[1]))
  np.testing.assert_array_equal(np.isfinite(np.asarray(got[1])), finite)
  lib.assert_close(got[0], want[0], 2e-2, 'out')
  lib.assert_close(jnp.where(finite, got[1], 0), jnp.where(finite, want[1], 0),
                   1e-4, 'lse')


def test_unsupported_inputs_are_refused_with_the_reason():
  with pytest.raises(ValueError, match='pair_order'):
    kv_outer.ForwardConfig(kernel='mosaic')
  with pytest.raises(ValueError, match="'triton' or 'mosaic'"):
    kv_outer.ForwardConfig(kernel='cuda')
  with pytest.raises(ValueError, match='bf16'):
    kv_outer_mosaic.check_shapes(16, 128, 128, 4, jnp.float32)
  with pytest.raises(ValueError, match='8-row parts'):
    kv_outer_mosaic.check_shapes(4, 128, 128, 16, jnp.bfloat16)
  with pytest.raises(ValueError, match='multiples of 16'):
    kv_outer_mosaic.check_shapes(16, 128, 8, 4, jnp.bfloat16)


@lib.with_cuda_lowering
def test_lowers_for_cuda_at_real_shapes():
  """The GPU bench's head shapes (16 heads a group, D = 128, 128-key
  blocks, K = 16): a 2k prefill, whose few blocks give long per-item
  windows (tables copied in 256-row parts), one Mosaic GPU call per query
  chunk beside the plan's and the combine's XLA."""
  b, t, g, r, d, c, k = 1, 2048, 4, 16, 128, 128, 16
  bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  cfg = kv_outer.ForwardConfig(pair_order=True, kernel='mosaic')
  f = functools.partial(pallas_path.sparse_forward, block_size=c,
                        backend='gpu', interpret=False, kv_config=cfg)
  text = jax.jit(f).trace(
      bf16(b, t, g * r, d), bf16(b, t, g, d), bf16(b, t, g, d),
      jax.ShapeDtypeStruct((b, g, t, k), jnp.int32),
      jax.ShapeDtypeStruct((b,), jnp.int32)).lower(
          lowering_platforms=('cuda',)).as_text()
  assert 'mosaic_gpu' in text
