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
