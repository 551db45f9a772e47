"""The GPU grouped matmul (pallas_kernels/grouped_matmul) in interpret
mode against its jnp reference: the tile matmul, the per-slot transposed
matmul, their VJP, and through grouped_swiglu against the loop kinds."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from foremoe_jax.model import grouped_swiglu
from pallas_kernels.grouped_matmul import kernel as gm
from pallas_kernels.grouped_matmul import reference


def _tiles(rng, n=7, t=16, k=64, big_n=48, s=4, used=5):
  x = jnp.asarray(rng.normal(size=(n, t, k)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(s, k, big_n)), jnp.float32)
  # Slot order with an empty slot (2) and a slot of several tiles.
  slot = jnp.asarray([0, 1, 1, 3, 3, 3, 3][:n], jnp.int32)
  return x, w, slot, jnp.asarray([used], jnp.int32)


def test_tile_matmul_and_its_vjp_equal_the_reference():
  rng = np.random.default_rng(0)
  x, w, slot, used = _tiles(rng)
  run = jax.jit(functools.partial(gm.tile_matmul, interpret=True))
  y = run(x, w, slot, used)
  want = reference.tile_matmul(x, w, slot, used)
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
  assert not np.asarray(y[5:]).any()  # tiles past num_used: zeros
  dy = jnp.asarray(rng.normal(size=y.shape), jnp.float32)
  _, vjp = jax.vjp(lambda a, b: gm.tile_matmul(a, b, slot, used, True), x, w)
  _, vjp_ref = jax.vjp(
      lambda a, b: reference.tile_matmul(a, b, slot, used), x, w)
  for got, ref, name in zip(vjp(dy), vjp_ref(dy), ('dx', 'dw')):
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4, err_msg=name)


def test_slot_sums_walk_each_slots_tiles_by_hand():
  # dw[s] = sum of a[i]^T b[i] over slot s's live tiles, in numpy; slot 2
  # has none and a tile past num_used is left out.
  rng = np.random.default_rng(1)
  a = rng.normal(size=(7, 16, 64)).astype(np.float32)
  b = rng.normal(size=(7, 16, 32)).astype(np.float32)
  slot = np.array([0, 1, 1, 3, 3, 3, 3], np.int32)
  dw = jax.jit(functools.partial(gm.slot_matmul_t, num_slots=4,
                                 interpret=True))(
      jnp.asarray(a), jnp.asarray(b), jnp.asarray(slot),
      jnp.asarray([6], jnp.int32))
  want = np.zeros((4, 64, 32), np.float32)
  for i in range(6):
    want[slot[i]] += a[i].T @ b[i]
  np.testing.assert_allclose(dw, want, rtol=1e-4, atol=1e-4)
  assert not np.asarray(dw[2]).any()


def test_bf16_tiles_with_a_float32_master():
  # Weights stored in f32 are cast per block to x's bf16; dw comes back in
  # f32, summed in f32.
  rng = np.random.default_rng(2)
  x, w, slot, used = _tiles(rng)
  xb = x.astype(jnp.bfloat16)
  y, vjp = jax.vjp(lambda a, b: gm.tile_matmul(a, b, slot, used, True),
                   xb, w)
  want = reference.tile_matmul(xb, w, slot, used)
  assert y.dtype == jnp.bfloat16
  np.testing.assert_allclose(y.astype(np.float32), want.astype(np.float32),
                             rtol=2e-2, atol=2e-2)
  dx, dw = vjp(jnp.ones_like(y))
  assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32


@pytest.mark.parametrize('dtype,tol', [(jnp.float32, 1e-4),
                                       (jnp.bfloat16, 5e-2)])
def test_grouped_swiglu_pallas_equals_the_tile_loop(dtype, tol):
  # The same tiles, by the loop ('tiles') and by one launch per matmul
  # ('pallas'): outputs of the labelled rows and all gradients.
  rng = np.random.default_rng(3)
  r, m, f, s, tile = 96, 32, 48, 4, 16
  x = jnp.asarray(rng.normal(size=(r, m)), dtype)
  label = jnp.asarray(rng.integers(-1, s, size=r), jnp.int32)
  label = label.at[label == 2].set(1)  # an empty slot
  w = [jnp.asarray(rng.normal(size=sh) * 0.2, jnp.float32)
       for sh in ((s, m, f), (s, m, f), (s, f, m))]

  def loss(kind, x, *w):
    y = grouped_swiglu.grouped_swiglu(x, label, *w, tile=tile, kind=kind)
    keep = (label >= 0)[:, None]
    return jnp.sum(jnp.where(keep, y.astype(jnp.float32), 0) ** 2), y

  grads = {}
  for kind in ('tiles', 'pallas'):
    (_, y), g = jax.jit(jax.value_and_grad(
        functools.partial(loss, kind), argnums=(0, 1, 2, 3),
        has_aux=True))(x, *w)
    grads[kind] = (np.where((np.asarray(label) >= 0)[:, None],
                            np.asarray(y, np.float32), 0), g)
  (y0, g0), (y1, g1) = grads['tiles'], grads['pallas']
  np.testing.assert_allclose(y1, y0, rtol=tol, atol=tol)
  for a, b in zip(g1, g0):
    scale = float(np.abs(np.asarray(b, np.float32)).max()) + 1e-6
    np.testing.assert_allclose(np.asarray(a, np.float32) / scale,
                               np.asarray(b, np.float32) / scale,
                               rtol=tol, atol=tol)


def test_shapes_a_triton_dot_cannot_take_are_refused_clearly():
  # K = 24 has a power-of-two factor of 8 only: a GPU compile would fail
  # deep in Triton; it is refused up front (interpret mode takes it).
  rng = np.random.default_rng(4)
  x, w, slot, used = _tiles(rng, k=24)
  with pytest.raises(ValueError, match='at least 16'):
    gm.tile_matmul(x, w, slot, used, False)
  y = gm.tile_matmul(x, w, slot, used, True)
  np.testing.assert_allclose(y, reference.tile_matmul(x, w, slot, used),
                             rtol=1e-5, atol=1e-5)


def test_tile_gathers_transpose_as_gathers():
  # Rows <-> tile slots by inverse partial maps (rows 1 and 4 are empty,
  # slots 0, 3, 6, 7 padding): the VJP equals autodiff's scatter-add, but is
  # itself a gather.
  rng = np.random.default_rng(4)
  a = jnp.asarray(rng.normal(size=(6, 3)), jnp.float32)
  to_Y = jnp.asarray([6, 0, 2, 6, 5, 3, 6, 6], jnp.int32)  # 6: no row
  from_X = jnp.asarray([1, 8, 2, 5, 8, 4], jnp.int32)      # 8: no slot
  c = jnp.asarray(rng.normal(size=(8, 3)), jnp.float32)
  mine = lambda a: jnp.sum(
      grouped_swiglu._gather_rows(a, to_Y, from_X) ** 2 * c)
  autodiff = lambda a: jnp.sum(
      jnp.take(a, to_Y, axis=0, mode='fill', fill_value=0) ** 2 * c)
  np.testing.assert_allclose(mine(a), autodiff(a), rtol=1e-6)
  np.testing.assert_allclose(jax.grad(mine)(a), jax.grad(autodiff)(a),
                             rtol=1e-6)
  assert not np.asarray(jax.grad(mine)(a))[[1, 4]].any()
  text = str(jax.make_jaxpr(jax.grad(mine))(a))
  assert 'scatter' not in text and 'gather' in text
  assert 'scatter' in str(jax.make_jaxpr(jax.grad(autodiff))(a))


def _rows_case(rng, r=50, n=7, t=8, k=32, big_n=48, s=4, used=5):
  """Rows [r, k] in random tile slots (slot order 0,1,1,3,3,3,3; tile 6
  past num_used), some slots empty (src r), some rows in no tile."""
  slot = np.asarray([0, 1, 1, 3, 3, 3, 3][:n], np.int32)
  src = np.full((n, t), r, np.int32)
  live_slots = [(i, j) for i in range(used) for j in range(t)
                if (i * t + j) % 5 != 4]  # every fifth slot empty
  rows = rng.permutation(r)[:len(live_slots)]
  for (i, j), row in zip(live_slots, rows):
    src[i, j] = row
  src[6, :3] = rng.permutation(r)[:3] * 0 + r  # past num_used: none
  x = jnp.asarray(rng.normal(size=(r, k)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(s, k, big_n)), jnp.float32)
  return x, w, jnp.asarray(src), jnp.asarray(slot), jnp.asarray([used],
                                                                 jnp.int32)


def test_rows_layout_reference_by_hand():
  # Rows in, rows out: row src[i, j] of the output is row src[i, j] of x
  # times w[slot[i]] for live tiles; every other row zero.
  rng = np.random.default_rng(5)
  x, w, src, slot, used = _rows_case(rng)
  y = reference.grouped_matmul(x, w, src, slot, used, a_rows=True,
                               out_rows=50)
  want = np.zeros((50, 48), np.float32)
  for i in range(int(used[0])):
    for j in range(src.shape[1]):
      if src[i, j] < 50:
        want[src[i, j]] = np.asarray(x)[src[i, j]] @ np.asarray(w)[slot[i]]
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('a_rows,out_rows', [(True, None), (False, 50),
                                             (True, 50)])
def test_rows_layouts_and_their_vjp_equal_the_reference(a_rows, out_rows):
  rng = np.random.default_rng(6)
  x, w, src, slot, used = _rows_case(rng)
  a = x if a_rows else reference.rows_to_tiles(x, src)
  def run(interpret):
    fn = lambda a_, w_: gm.grouped_matmul(a_, w_, src, slot, used, a_rows,
                                          out_rows, interpret)
    y, vjp = jax.vjp(fn, a, w)
    dy = jnp.asarray(np.random.default_rng(7).normal(size=y.shape),
                     jnp.float32)
    return (y, *vjp(dy))
  ref = lambda a_, w_: reference.grouped_matmul(
      a_, w_, src, slot, used, a_rows=a_rows, out_rows=out_rows)
  y_ref, vjp_ref = jax.vjp(ref, a, w)
  dy = jnp.asarray(np.random.default_rng(7).normal(size=y_ref.shape),
                   jnp.float32)
  want = (y_ref, *vjp_ref(dy))
  got = jax.jit(lambda: run(True))()
  for g, r_, name in zip(got, want, ('y', 'da', 'dw')):
    np.testing.assert_allclose(g, r_, rtol=1e-4, atol=1e-4, err_msg=name)
  # The platform rule on CPU runs the reference: the same values.
  for g, r_ in zip(jax.jit(lambda: run(None))(), want):
    np.testing.assert_allclose(g, r_, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('interpret', [True, None])
def test_swiglu_rows_and_its_vjp_against_each_row_through_its_slot(
    interpret):
  # Rows in, rows out, the kernels in interpret mode (and the platform
  # rule's reference): y[r] = (silu(x[r] wg) * (x[r] wu)) wd for the slot
  # of the tile slot holding r, autodiff'd per row in jnp; rows no live
  # tile holds give zeros and get zero gradient.
  rng = np.random.default_rng(8)
  x, wg, src, slot, used = _rows_case(rng, big_n=32)
  wu = jnp.asarray(rng.normal(size=wg.shape), jnp.float32)
  wd = jnp.asarray(rng.normal(size=(4, 32, 32)), jnp.float32)
  src_np, slot_np = np.asarray(src), np.asarray(slot)
  slot_of_row = np.full(50, -1)
  for i in range(int(used[0])):
    for j in range(src_np.shape[1]):
      if src_np[i, j] < 50:
        slot_of_row[src_np[i, j]] = slot_np[i]
  held = jnp.asarray(slot_of_row >= 0)
  s_r = jnp.asarray(np.maximum(slot_of_row, 0))

  def per_row(x_, wg_, wu_, wd_):
    h = (jax.nn.silu(jnp.einsum('rm,rmf->rf', x_, wg_[s_r]))
         * jnp.einsum('rm,rmf->rf', x_, wu_[s_r]))
    return jnp.where(held[:, None], jnp.einsum('rf,rfm->rm', h, wd_[s_r]), 0)

  dy = jnp.asarray(rng.normal(size=(50, 32)), jnp.float32)
  mine = lambda *w: gm.swiglu(*w, src, slot, used, interpret)
  y, vjp = jax.vjp(mine, x, wg, wu, wd)
  y_ref, vjp_ref = jax.vjp(per_row, x, wg, wu, wd)
  np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-4)
  for got, want, name in zip(vjp(dy), vjp_ref(dy),
                             ('dx', 'dwg', 'dwu', 'dwd')):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3,
                               err_msg=name)
  assert not np.asarray(y)[~np.asarray(held)].any()
