"""The grouped matmul's Triton kernels on one NVIDIA GPU, against the jnp
reference (pallas_kernels/grouped_matmul/reference.py).

Run by `make gpu-check`; skipped without a GPU. interpret=False runs the
kernels whatever the platform rule picks: the forward, the VJP's dx (w
read transposed in the kernel) and dw (per-slot sums written in w's
dtype), with tiles past num_used, an empty slot and a slot of several
tiles. The reference multiplies at Precision.HIGHEST; the f32 kernels use
TF32x3, so f32 tolerances stay tight.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import kernel as gm
from pallas_kernels.grouped_matmul import reference

pytestmark = pytest.mark.gpu


def _case(rng, dtype, w_dtype, n=9, t=128, k=256, big_n=384, s=5, used=7):
  x = jnp.asarray(rng.normal(size=(n, t, k)), dtype)
  w = jnp.asarray(rng.normal(size=(s, k, big_n)) / k ** 0.5, w_dtype)
  slot = jnp.asarray([0, 0, 1, 3, 3, 3, 4, 4, 4][:n], jnp.int32)  # 2: none
  dy = jnp.asarray(rng.normal(size=(n, t, big_n)), dtype)
  return x, w, slot, jnp.asarray([used], jnp.int32), dy


@pytest.mark.parametrize('dtype,w_dtype,tol', [
    (jnp.float32, jnp.float32, 1e-4),
    (jnp.bfloat16, jnp.float32, 2e-2),
    (jnp.bfloat16, jnp.bfloat16, 2e-2)])
def test_kernels_and_vjp_match_the_reference(dtype, w_dtype, tol):
  x, w, slot, used, dy = _case(np.random.default_rng(0), dtype, w_dtype)

  def run(fn):
    y, vjp = jax.vjp(lambda a, b: fn(a, b, slot, used), x, w)
    return (y, *vjp(dy))

  with jax.default_matmul_precision('highest'):
    want = jax.jit(functools.partial(run, reference.tile_matmul))()
  got = jax.jit(functools.partial(
      run, lambda a, b, s_, u: gm.tile_matmul(a, b, s_, u, False)))()
  for g, r, name in zip(got, want, ('y', 'dx', 'dw')):
    assert g.dtype == r.dtype, name
    g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
    np.testing.assert_allclose(g, r, rtol=tol, atol=tol * np.abs(r).max(),
                               err_msg=name)
  # Tiles past num_used write zeros; slot 2 has no tile, so no gradient.
  assert not np.asarray(got[0][7:], np.float32).any()
  assert not np.asarray(got[2][2], np.float32).any()


@pytest.mark.parametrize('dtype,w_dtype,tol', [
    (jnp.float32, jnp.float32, 1e-4),
    (jnp.bfloat16, jnp.float32, 3e-2)])
def test_swiglu_rows_in_and_out_match_the_reference(dtype, w_dtype, tol):
  # The layer's GPU path: rows gathered by the kernels as they read, the
  # output and dx scattered as they write (dx in two launches, the second
  # adding), against the same composition of the jnp reference.
  rng = np.random.default_rng(1)
  r, n, t, m, f, s, used = 700, 9, 128, 256, 384, 5, 7
  slot = jnp.asarray([0, 0, 1, 3, 3, 3, 4, 4, 4], jnp.int32)
  src = np.full((n, t), r, np.int32)
  slots = [(i, j) for i in range(used) for j in range(t) if (i + j) % 3]
  rows = rng.permutation(r)[:len(slots)]
  for (i, j), row in zip(slots, rows):
    src[i, j] = row
  src = jnp.asarray(src)
  x = jnp.asarray(rng.normal(size=(r, m)), dtype)
  ws = [jnp.asarray(rng.normal(size=sh) / sh[1] ** 0.5, w_dtype)
        for sh in [(s, m, f), (s, m, f), (s, f, m)]]
  dy = jnp.asarray(rng.normal(size=(r, m)), dtype)
  used_1 = jnp.asarray([used], jnp.int32)

  def ref(x_, wg, wu, wd):
    mm = lambda a, w, **kw: reference.grouped_matmul(a, w, src, slot,
                                                     used_1, **kw)
    h = jax.nn.silu(mm(x_, wg, a_rows=True)) * mm(x_, wu, a_rows=True)
    return mm(h, wd, out_rows=r)

  def run(fn):
    y, vjp = jax.vjp(fn, x, *ws)
    return (y, *vjp(dy))

  with jax.default_matmul_precision('highest'):
    want = jax.jit(lambda: run(ref))()
  got = jax.jit(lambda: run(
      lambda *a: gm.swiglu(*a, src, slot, used_1, False)))()
  for g, w_, name in zip(got, want, ('y', 'dx', 'dwg', 'dwu', 'dwd')):
    assert g.dtype == w_.dtype, name
    g, w_ = np.asarray(g, np.float32), np.asarray(w_, np.float32)
    np.testing.assert_allclose(g, w_, rtol=tol, atol=tol * np.abs(w_).max(),
                               err_msg=name)
  # Rows in no tile: zero output, zero gradient.
  empty = np.setdiff1d(np.arange(r), rows)
  assert not np.asarray(got[0], np.float32)[empty].any()
  assert not np.asarray(got[1], np.float32)[empty].any()
