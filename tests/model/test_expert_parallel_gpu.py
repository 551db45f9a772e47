"""The expert-parallel layer on one NVIDIA GPU (a 1 x 1 mesh).

Run by `make gpu-check`; skipped without a GPU. With one EP device every
slot is local, but dispatch, the slot split rule, the grouped SwiGLU (the
Triton grouped matmul, and XLA's ragged_dot) and their custom VJPs all run
as on a larger mesh; the loop-over-experts
reference is the independent check. Matmuls run at Precision.HIGHEST so the
GPU's TF32 default does not hide a real error behind a loose tolerance.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gpu_rehearsal
from foremoe_jax import placement as placement_lib
from foremoe_jax.model import expert_parallel as ep
from foremoe_jax.model.moe_reference import reference_moe_ffn

pytestmark = pytest.mark.gpu

E, M, F, N, K = 16, 32, 48, 256, 2


def _inputs(rng):
  x = rng.normal(size=(N, M)).astype(np.float32)
  ids = np.stack([rng.choice(E, K, replace=False) for _ in range(N)])
  ids[: N // 4, 0] = 0  # a hot expert, so replicas and splits carry tokens
  gates = rng.random((N, K)).astype(np.float32)
  valid = rng.random(N) > 0.1
  w = [rng.normal(size=s).astype(np.float32) * 0.3
       for s in [(E, M, F), (E, M, F), (E, F, M)]]
  return [jnp.asarray(a) for a in (x, ids.astype(np.int32), gates, valid, *w)]


def _placement_with_replicas(rng, spd):
  """Every expert once plus random replicas, shares summing to one."""
  se = rng.permutation(np.concatenate(
      [np.arange(E), rng.integers(0, E, spd - E)])).astype(np.int32)
  share = rng.random((1, spd)).astype(np.float32) + 0.05
  tot = np.zeros(E)
  np.add.at(tot, se, share[0])
  return placement_lib.Placement(se[None], (share / tot[se])[None])


@pytest.mark.parametrize('gemm', ['pallas', 'ragged_dot'])
def test_routed_experts_match_reference_on_gpu(gemm):
  # pallas: the GPU default, the Triton grouped matmul; ragged_dot: XLA's
  # (dense GEMMs over every group on a GPU, kept as a second opinion).
  assert gpu_rehearsal.platform() == 'gpu'
  rng = np.random.default_rng(0)
  x, ids, gates, valid, wg, wu, wd = _inputs(rng)
  mesh = ep.make_mesh(1, 1)
  spd = 24
  with jax.default_matmul_precision('highest'):
    (_, y_ref), g_ref = jax.jit(jax.value_and_grad(
        lambda x, gates, wg, wu, wd: (lambda y: (jnp.sum(jnp.sin(y)), y))(
            reference_moe_ffn(x, ids, gates, valid, wg, wu, wd)),
        argnums=(0, 1, 2, 3, 4), has_aux=True))(x, gates, wg, wu, wd)

    def ep_loss(x, gates, wg, wu, wd, se, share):
      y, _ = ep.routed_experts(x, ids, gates, valid, wg, wu, wd, se, share,
                               mesh=mesh, capacity=N * K, gemm=gemm)
      return jnp.sum(jnp.sin(y)), y

    ep_grad = jax.jit(jax.value_and_grad(ep_loss, argnums=(0, 1, 2, 3, 4),
                                         has_aux=True))
    for p in [placement_lib.identity_placement(1, E, 1, spd),
              _placement_with_replicas(rng, spd)]:
      placement_lib.validate_placement(p, E, spd)
      (_, y), g = ep_grad(x, gates, wg, wu, wd, p.slot_expert[0],
                          p.slot_share[0])
      # f32 sums in another order: against a float64 reference the f32
      # reference itself is off by up to 2e-6 of each gradient's largest
      # entry (the gate gradients reach 66), and so are ragged_dot and the
      # tile kinds on CPU. A tolerance of 1e-5 absolute failed them; a
      # wrong row is off by O(1) of it.
      for a, b, name in zip((y, *g), (y_ref, *g_ref),
                            ('y', 'dx', 'dgates', 'dwg', 'dwu', 'dwd')):
        np.testing.assert_allclose(a, b, rtol=1e-5,
                                   atol=2e-5 * np.abs(b).max(), err_msg=name)
