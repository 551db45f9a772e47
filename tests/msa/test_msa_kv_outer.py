"""The KV-outer GPU kernels (kv_outer.py) in interpret mode.

The tiles against a numpy loop over the selection; the forward, its
gradients and split-K decode against the dense reference (and the
per-token kernels they replace); the dK/dV work split against the unsplit
one, bit for bit; Triton lowering at real shapes (compiles nothing).
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import msa_testlib as lib
from pallas_kernels.msa import kv_outer
from pallas_kernels.msa import pallas_path
from pallas_kernels.msa import reference as ref


def _selection(name, seed=0):
  b, t, s, g, r, d, di, c, k, o = lib.SHAPES[name]
  q, kk, v, qi, ki, w = lib.make_inputs(b, t, s, g, r, d, di, seed=seed)
  sel = ref.selection_BGTK(qi, ki, block_size=c, top_k=k, q_offset=o)
  return (q, kk, v, w, sel), (b, t, s, g, r, d, c, k, o)


@pytest.mark.parametrize('q_per_tile', [1, 3, 8])
def test_tiles_hold_every_selected_pair_once(q_per_tile):
  (_, _, _, _, sel), (b, t, s, g, _, _, c, k, _) = _selection('ragged_chunk')
  # Some -1 slots too (a selection may hold fewer than K blocks).
  sel = np.array(sel)
  sel[:, :, ::5, 0] = -1
  n_blocks = -(-s // c)
  t0 = 7
  tile_blk, tile_q, pair = jax.jit(functools.partial(
      kv_outer.build_tiles, n_blocks=n_blocks, q_per_tile=q_per_tile,
      t0=t0))(jnp.asarray(sel))
  tile_blk, tile_q, pair = map(np.asarray, (tile_blk, tile_q, pair))
  n_tiles = tile_blk.shape[-1]
  assert n_tiles == -(-t * k // q_per_tile) + n_blocks
  lanes = tile_q.reshape(b, g, -1)
  for bb in range(b):
    for gg in range(g):
      seen = np.zeros(n_tiles * q_per_tile, int)
      for tt in range(t):
        for kk in range(k):
          lane = pair[bb, gg, tt * k + kk]
          if sel[bb, gg, tt, kk] < 0:
            assert lane == -1
            continue
          # The lane holds this token, in a tile reading this block.
          assert lanes[bb, gg, lane] == t0 + tt
          assert tile_blk[bb, gg, lane // q_per_tile] == sel[bb, gg, tt, kk]
          seen[lane] += 1
      # No lane holds two pairs; filled lanes are exactly the pairs.
      assert seen.max() <= 1
      np.testing.assert_array_equal(seen > 0, lanes[bb, gg] >= 0)
      # A block's tiles are contiguous and all but its last are full.
      used = tile_blk[bb, gg] >= 0
      blocks = tile_blk[bb, gg][used]
      assert np.all(np.diff(blocks) >= 0)
      fill = (tile_q[bb, gg] >= 0).sum(-1)[used]
      last = np.append(blocks[1:] != blocks[:-1], True)
      assert np.all(fill[~last] == q_per_tile)


def _kernel_attention(gpu_kernels, off, c, valid=None):
  return lambda q, k, v, sel: pallas_path.sparse_attention(
      q, k, v, sel, off, c, 'gpu', True, valid, gpu_kernels)


def _loss(attn, w, sel):
  def loss(q, k, v):
    out, lse = attn(q, k, v, sel)
    return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(jnp.sin(lse))
  return loss


@pytest.mark.parametrize('gpu_kernels', ['kv_outer', 'token'])
@pytest.mark.parametrize('dtype,tol', [(jnp.float32, 1e-5),
                                       (jnp.bfloat16, 2e-2)])
def test_forward_and_gradients_match_reference(gpu_kernels, dtype, tol):
  (q, kk, v, w, sel), (b, _, _, _, _, _, c, _, o) = _selection('ragged_chunk')
  q, kk, v = (x.astype(dtype) for x in (q, kk, v))
  off = jnp.full((b,), o, jnp.int32)
  kern = _kernel_attention(gpu_kernels, off, c)
  slow = lambda q, k, v, sel: ref.sparse_attention(
      q, k, v, sel, block_size=c, q_offset=o)
  f32 = lambda *xs: [x.astype(jnp.float32) for x in xs]
  got = jax.jit(kern)(q, kk, v, sel)
  want = slow(*f32(q, kk, v), sel)
  assert got[0].dtype == dtype
  lib.assert_close(got[0], want[0], tol, 'out')
  lib.assert_close(got[1], want[1], tol, 'lse')
  g_got = jax.jit(jax.grad(_loss(kern, w, sel), argnums=(0, 1, 2)))(q, kk, v)
  g_want = jax.grad(_loss(slow, w, sel), argnums=(0, 1, 2))(*f32(q, kk, v))
  for name, a, e in zip('qkv', g_got, g_want):
    assert a.dtype == dtype, (name, a.dtype)
    lib.assert_close(a, e, tol, f'd{name}')


def test_query_chunks_and_padding_keys():
  b, t, s, g, r, d, di, c, k, o = lib.SHAPES['gqa']
  q, kk, v, qi, ki, _ = lib.make_inputs(b, t, s, g, r, d, di, seed=2)
  valid = np.ones((b, s), bool)
  valid[0, :19] = False  # a whole padding block and part of the next
  valid = jnp.asarray(valid)
  sel = ref.selection_BGTK(qi, ki, block_size=c, top_k=k, q_offset=o,
                           kv_valid_BS=valid)
  want = ref.sparse_attention(q, kk, v, sel, block_size=c, q_offset=o,
                              kv_valid_BS=valid)
  rp, dp = 2, 16
  qg = pallas_path._to_gpu_q(q, g, rp, dp)
  pad = lambda x: pallas_path._pad_axis(x, 3, dp)
  vmask = valid.astype(jnp.int32)
  # 95 and 19 leave a one-token last chunk (T = 96), which must not be
  # merged as decode's single chunk is (its partials are in tile order).
  for chunk in (None, 16, 40, 95, 19):
    out, lse = jax.jit(functools.partial(
        kv_outer.forward, block_size=c, scale=1 / math.sqrt(d),
        interpret=True, config=kv_outer.ForwardConfig(query_chunk=chunk)))(
            qg, pad(kk), pad(v), sel, jnp.full((b,), o, jnp.int32), vmask)
    lib.assert_close(out[..., :r, :d].reshape(b, t, g * r, d), want[0], 1e-5,
                     f'out chunk {chunk}')
    got_lse = lse[..., :r].reshape(b, t, g * r)
    finite = np.isfinite(np.asarray(want[1]))
    np.testing.assert_array_equal(np.isfinite(np.asarray(got_lse)), finite)
    lib.assert_close(jnp.where(finite, got_lse, 0),
                     jnp.where(finite, want[1], 0), 1e-5, 'lse')


# The knobs the GPU bench times against each other (benchmark_gpu.TUNE):
# each must give the default's result, bit for bit where it changes only
# where a partial is written or when a tile is gathered.
_CONFIGS = [kv_outer.ForwardConfig(pair_order=True),
            kv_outer.ForwardConfig(prefetch=True),
            kv_outer.ForwardConfig(pair_order=True, prefetch=True,
                                   tiles_per_program=1),
            kv_outer.ForwardConfig(pair_order=True, q_per_tile=3,
                                   num_warps=4, num_stages=3),
            kv_outer.ForwardConfig(pair_order=True, fused_combine=True)]


@pytest.mark.parametrize('config', _CONFIGS, ids=lambda c: c.label())
def test_forward_configs_equal_the_default_and_the_reference(config):
  (q, kk, v, _, sel), (b, t, s, g, r, d, c, k, o) = _selection('ragged_chunk')
  sel = np.array(sel)
  sel[:, :, ::5, 0] = -1  # -1 slots: their pair-order rows are never written
  sel = jnp.asarray(sel)
  valid = np.ones((b, s), bool)
  valid[:, 20:37] = False  # a whole padding block and part of the next
  valid = jnp.asarray(valid)
  off = jnp.full((b,), o, jnp.int32)
  run = lambda cfg: jax.jit(lambda q, k_, v_, sel: pallas_path.sparse_forward(
      q, k_, v_, sel, off, valid, block_size=c, backend='gpu', interpret=True,
      kv_config=cfg))(q, kk, v, sel)
  got, base = run(config), run(None)
  want = ref.sparse_attention(q, kk, v, sel, block_size=c, q_offset=o,
                              kv_valid_BS=valid)
  finite = np.isfinite(np.asarray(want[1]))
  np.testing.assert_array_equal(np.isfinite(np.asarray(got[1])), finite)
  lib.assert_close(got[0], want[0], 1e-5, 'out')
  lib.assert_close(jnp.where(finite, got[1], 0), jnp.where(finite, want[1], 0),
                   1e-5, 'lse')
  # (the fused combine merges in another order: equal to rounding, above)
  if config.q_per_tile is None and not config.fused_combine:
    for a, e in zip(got, base):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_fused_combine_equals_the_xla_merge(dtype):
  # Random pair-order partials, with -1 slots whose rows hold NaN (never
  # written by the kernel) and a token none of whose slots is live.
  b, g, t, k, rp, dp = 2, 3, 12, 5, 4, 16
  rng = np.random.default_rng(3)
  pair = np.arange(t * k, dtype=np.int32)[None, None].repeat(b, 0).repeat(
      g, 1)
  dead = rng.random((b, g, t * k)) < 0.3
  dead[0, 1, 5 * k:6 * k] = True  # token 5 of (0, 1): nothing live
  pair = np.where(dead, -1, pair)
  n = t * k * rp + 1
  o = rng.normal(size=(b, g, n, dp)).astype(np.float32)
  lse = rng.normal(size=(b, g, n)).astype(np.float32) * 3
  rows_dead = np.repeat(dead, rp, axis=2)
  o[:, :, :-1][rows_dead] = np.nan
  lse[:, :, :-1][rows_dead] = np.nan
  o = jnp.asarray(o, dtype)
  want_out, want_lse = kv_outer.combine_pairs(
      o, jnp.asarray(lse), jnp.asarray(pair), top_k=k, heads_p=rp)
  for tokens in (None, 1, 4):
    got_out, got_lse = jax.jit(functools.partial(
        kv_outer.combine_kernel, top_k=k, heads_p=rp, dtype=dtype,
        interpret=True, tokens=tokens))(o, jnp.asarray(lse), jnp.asarray(pair))
    assert got_out.dtype == dtype and got_out.shape == (b, t, g, rp, dp)
    np.testing.assert_array_equal(np.isneginf(np.asarray(got_lse)),
                                  np.isneginf(np.asarray(want_lse)))
    assert np.isneginf(np.asarray(got_lse)[0, 5, 1]).all()
    assert not np.isnan(np.asarray(got_out, np.float32)).any()
    fin = np.isfinite(np.asarray(want_lse))
    np.testing.assert_allclose(np.asarray(got_lse)[fin],
                               np.asarray(want_lse)[fin], rtol=1e-6,
                               atol=1e-6)
    # bf16: one rounding of the output, against the f32 merge.
    tol = 1e-6 if dtype == jnp.float32 else 2**-8
    np.testing.assert_allclose(np.asarray(got_out, np.float32),
                               np.asarray(want_out, np.float32), rtol=tol,
                               atol=tol)
  with pytest.raises(ValueError, match='divide'):
    kv_outer.combine_kernel(o, jnp.asarray(lse), jnp.asarray(pair), top_k=k,
                            heads_p=rp, dtype=dtype, interpret=True,
                            tokens=5)


def test_fused_combine_needs_pair_order():
  with pytest.raises(ValueError, match='pair_order'):
    kv_outer.ForwardConfig(fused_combine=True)


def test_gradients_through_a_forward_config_equal_the_default():
  # The custom VJP saves the tuned forward's out and LSE; the backward's
  # kernels are the default's, so the gradients must be the same bits.
  (q, kk, v, w, sel), (b, _, _, _, _, _, c, _, o) = _selection('ragged_chunk')
  off = jnp.full((b,), o, jnp.int32)
  grads = lambda cfg: jax.jit(jax.grad(_loss(
      lambda q, k_, v_, sel: pallas_path.sparse_attention(
          q, k_, v_, sel, off, c, 'gpu', True, kv_config=cfg), w, sel),
      argnums=(0, 1, 2)))(q, kk, v)
  config = kv_outer.ForwardConfig(pair_order=True, prefetch=True)
  for a, e in zip(grads(config), grads(None)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def test_backward_parts_are_the_whole_backwards_parts():
  (q, kk, v, w, sel), (b, _, _, _, _, _, c, _, o) = _selection('gqa', seed=5)
  off = jnp.full((b,), o, jnp.int32)
  out, lse = pallas_path.sparse_forward(q, kk, v, sel, off, None, block_size=c,
                                        backend='gpu', interpret=True)
  run = lambda parts: jax.jit(lambda q, k_, v_: pallas_path.sparse_backward(
      q, k_, v_, sel, off, None, out, lse, w, None, block_size=c,
      backend='gpu', interpret=True, parts=parts))(q, kk, v)
  whole, dq, dkv = run('all'), run('dq'), run('dkv')
  assert dq[1] is None and dq[2] is None and dkv[0] is None
  for a, e in zip((dq[0], dkv[1], dkv[2]), whole):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
  with pytest.raises(ValueError, match='parts'):
    pallas_path.sparse_backward(q, kk, v, sel, off, None, out, lse, w, None,
                                block_size=c, backend='tpu', interpret=True,
                                parts='dq')


def test_pair_order_decode_equals_reference():
  b, s, g, r, d, di, c, k = 3, 120, 2, 3, 16, 8, 16, 4
  q, kk, v, qi, ki, _ = lib.make_inputs(b, 1, s, g, r, d, di)
  lengths = jnp.array([s, 61, 9])
  sel = ref.selection_BGTK(qi, ki, block_size=c, top_k=k,
                           q_offset=lengths - 1)
  got = jax.jit(lambda q, k_, v_, sel: pallas_path.sparse_forward(
      q, k_, v_, sel, lengths - 1, None, block_size=c, backend='gpu',
      interpret=True, kv_config=kv_outer.ForwardConfig(pair_order=True)))(
          q, kk, v, sel)
  want = ref.sparse_attention(q, kk, v, sel, block_size=c,
                              q_offset=lengths - 1)
  lib.assert_close(got[0], want[0], 1e-5, 'out')
  lib.assert_close(got[1], want[1], 1e-5, 'lse')


def test_pair_rows_invert_the_lane_map():
  (_, _, _, _, sel), (b, t, s, g, _, _, c, k, _) = _selection('gqa')
  sel = np.array(sel)
  sel[:, :, ::3, 1] = -1
  tile_blk, tile_q, pair = kv_outer.build_tiles(
      jnp.asarray(sel), n_blocks=-(-s // c), q_per_tile=3)
  rp = 2
  rows = np.asarray(kv_outer.pair_rows(pair, tile_q.shape[2] * 3,
                                       heads_p=rp))
  pair = np.asarray(pair)
  for bb in range(b):
    for gg in range(g):
      for p_ in range(t * k):
        lane = pair[bb, gg, p_]
        if lane < 0:
          assert p_ * rp not in rows[bb, gg]  # a -1 slot gets no row
          continue
        np.testing.assert_array_equal(
            rows[bb, gg, lane * rp:(lane + 1) * rp], p_ * rp + np.arange(rp))
      # Every other lane is empty.
      filled = np.zeros(rows.shape[-1] // rp, bool)
      filled[pair[bb, gg][pair[bb, gg] >= 0]] = True
      assert np.all(rows[bb, gg].reshape(-1, rp)[~filled] == -1)


def test_split_work_is_bit_identical_to_one_program_per_block():
  (q, kk, v, w, sel), (b, t, s, g, r, d, c, k, o) = _selection('gqa', seed=3)
  rp, dp = 2, 16
  out, lse = ref.sparse_attention(q, kk, v, sel, block_size=c, q_offset=o)
  delta = jnp.sum(w * out, -1)
  rows = lambda x: x.reshape(b, t, g, r)
  args = (pallas_path._to_gpu_q(q, g, rp, dp), pallas_path._pad_axis(kk, 3, dp),
          pallas_path._pad_axis(v, 3, dp), sel, jnp.full((b,), o, jnp.int32),
          jnp.ones((b, s), jnp.int32), pallas_path._to_gpu_q(w, g, rp, dp),
          rows(lse), rows(delta))
  run = lambda n: jax.jit(functools.partial(
      kv_outer.dkv, block_size=c, scale=1 / math.sqrt(d), interpret=True,
      tiles_per_program=n))(*args)
  whole, split = run(1000), run(1)
  for a, e in zip(split, whole):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
  # The prefetch variant gathers earlier and computes the same bits (at
  # two tiles a program, so a program's loop runs past its first tile).
  pair = lambda pre: jax.jit(functools.partial(
      kv_outer.dkv, block_size=c, scale=1 / math.sqrt(d), interpret=True,
      tiles_per_program=2, prefetch=pre))(*args)
  for a, e in zip(pair(True), pair(False)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
  # The forward's programs split the same way, with the same result.
  fwd = lambda n: jax.jit(functools.partial(
      kv_outer.forward, block_size=c, scale=1 / math.sqrt(d), interpret=True,
      config=kv_outer.ForwardConfig(tiles_per_program=n)))(*args[:6])
  for a, e in zip(fwd(1), fwd(1000)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
  # And they are the reference's gradients.
  _, vjp = jax.vjp(lambda k, v: ref.sparse_attention(
      q, k, v, sel, block_size=c, q_offset=o)[0], kk, v)
  dk, dv = vjp(w)
  lib.assert_close(whole[0][..., :d], dk, 1e-5, 'dk')
  lib.assert_close(whole[1][..., :d], dv, 1e-5, 'dv')


def test_work_items_launch_largest_first_and_cover_every_tile_once():
  # Causal selections load the early blocks most: with 2 tiles a program
  # those are split into several items. The launch order is by tile count,
  # most first; every block's tiles are covered once, by its own items;
  # and slot maps the block-order item numbering to the launch order.
  (_, _, _, _, sel), (b, t, s, g, r, d, c, k, o) = _selection('gqa', seed=3)
  n_blocks = -(-s // c)
  tile_blk, _, _ = kv_outer.build_tiles(sel, n_blocks=n_blocks, q_per_tile=2)
  per = 2
  blk, first, count, first_item, items, slot = (
      np.asarray(a) for a in kv_outer._work_items(tile_blk, n_blocks, per))
  tile_blk = np.asarray(tile_blk)
  assert (items > 1).any() and (count == 1).any()  # Split and partial.
  assert np.all(np.diff(count, axis=-1) <= 0)
  for bb in range(b):
    for gg in range(g):
      seen = np.zeros(tile_blk.shape[-1], int)
      for u in range(blk.shape[-1]):
        if count[bb, gg, u]:
          span = slice(first[bb, gg, u], first[bb, gg, u] + count[bb, gg, u])
          assert np.all(tile_blk[bb, gg, span] == blk[bb, gg, u])
          seen[span] += 1
        else:
          assert blk[bb, gg, u] == -1 or count[bb, gg, u] == 0
      np.testing.assert_array_equal(seen, tile_blk[bb, gg] >= 0)
      # Item i of block n (in block order) is launched at slot[first + i]:
      # its tiles are block n's i-th run of `per`.
      for n in range(n_blocks):
        for i in range(items[bb, gg, n]):
          u = slot[bb, gg, first_item[bb, gg, n] + i]
          assert blk[bb, gg, u] == n
          start = np.flatnonzero(tile_blk[bb, gg] == n)[0]
          assert first[bb, gg, u] == start + i * per


@pytest.mark.parametrize('c,dp', [(8, 16), (64, 128)])
def test_item_sums_add_each_blocks_items_in_item_order(c, dp):
  # The dK/dV sum launch against numpy: block n's items (block order) read
  # at their launch slots and added in that order, in f32, so the bits
  # match a sequential numpy sum. 64 x 128 is two chunks of a program.
  (_, _, _, _, sel), (b, t, s, g, r, d, _, k, o) = _selection('gqa', seed=3)
  n_blocks = -(-s // 8)
  tile_blk, _, _ = kv_outer.build_tiles(sel, n_blocks=n_blocks, q_per_tile=2)
  *_, first_item, items, slot = kv_outer._work_items(tile_blk, n_blocks, 2)
  n_items = slot.shape[-1]
  rng = np.random.default_rng(0)
  dk_u, dv_u = (rng.normal(size=(b, g, n_items, c, dp)).astype(np.float32)
                for _ in range(2))
  dk, dv = jax.jit(functools.partial(kv_outer._sum_items, interpret=True))(
      jnp.asarray(dk_u), jnp.asarray(dv_u), first_item, items, slot)
  first_item, items, slot = (np.asarray(a) for a in (first_item, items, slot))
  assert (items > 1).any() and (items == 0).any()
  for got, part in ((dk, dk_u), (dv, dv_u)):
    want = np.zeros((b, g, n_blocks, c, dp), np.float32)
    for bb in range(b):
      for gg in range(g):
        for n in range(n_blocks):
          for i in range(items[bb, gg, n]):
            want[bb, gg, n] += part[bb, gg,
                                    slot[bb, gg, first_item[bb, gg, n] + i]]
    np.testing.assert_array_equal(np.asarray(got), want)


def _dkv_case(dtype, c: int, k: int, seed: int, sp: int):
  """kv_outer.dkv's arguments on a ragged chunk with a padding hole
  (T 160 at offset 240, S 400 padded to sp, G 2, R 2, D 16, block c, top
  k), a runner over its knobs, and the reference's (dk, dv), in f32."""
  b, t, s, g, r, d, di, o = 1, 160, 400, 2, 2, 16, 8, 240
  q, kk, v, qi, ki, w = lib.make_inputs(b, t, s, g, r, d, di, seed=seed,
                                        dtype=dtype)
  valid = np.ones((b, s), bool)
  valid[:, 150:170] = False
  valid = jnp.asarray(valid)
  sel = ref.selection_BGTK(qi, ki, block_size=c, top_k=k, q_offset=o,
                           kv_valid_BS=valid)
  f32 = lambda x: x.astype(jnp.float32)
  attend = lambda k_, v_: ref.sparse_attention(
      f32(q), k_, v_, sel, block_size=c, q_offset=o, kv_valid_BS=valid)
  out, lse = attend(f32(kk), f32(v))
  rp, dp = 2, 16
  rows = lambda x: x.reshape(b, t, g, r)
  padk = lambda x: jnp.pad(x, ((0, 0), (0, sp - s), (0, 0), (0, 0)))
  args = (pallas_path._to_gpu_q(q, g, rp, dp), padk(kk), padk(v), sel,
          jnp.full((b,), o, jnp.int32),
          jnp.pad(valid, ((0, 0), (0, sp - s))).astype(jnp.int32),
          pallas_path._to_gpu_q(w, g, rp, dp), rows(lse),
          rows(jnp.sum(f32(w) * out, -1)))
  run = lambda **kw: jax.jit(functools.partial(
      kv_outer.dkv, block_size=c, scale=1 / math.sqrt(d), interpret=True,
      **kw))(*args)
  _, vjp = jax.vjp(lambda k_, v_: attend(k_, v_)[0], f32(kk), f32(v))
  return args, run, vjp(f32(w)), (s, d)


def test_f32_dkv_in_key_parts_equals_the_reference_and_whole_blocks(
    monkeypatch):
  # f32 on the GPU takes 32-row tiles and 32-key parts of each block
  # (_dkv_tiling: shared memory on an H100); at 128-key blocks that is 4
  # parts per block, with a causal diagonal and a padding hole in them.
  assert kv_outer._dkv_tiling(jnp.float32, 128, 16) == (2, 4)
  assert kv_outer._dkv_tiling(jnp.bfloat16, 128, 16) == (8, 1)
  _, run, want, (s, d) = _dkv_case(jnp.float32, 128, 2, seed=4, sp=512)
  parts = run()
  for got, ref_, name in zip(parts, want, ('dk', 'dv')):
    lib.assert_close(got[:, :s, :, :d], ref_, 1e-5, name)
  # Whole blocks, the tiling bf16 uses, give the same sums.
  monkeypatch.setattr(kv_outer, '_dkv_tiling', lambda dt, c_, hp: (8, 1))
  for a, e in zip(run(), parts):
    lib.assert_close(a, e, 1e-5, 'parts vs whole')


def test_bf16_dkv_in_key_parts_equals_whole_blocks_and_the_reference():
  # key_parts=2 is the variant the GPU bench times beside the default
  # (whole blocks spill registers on an H100: experiments/gpu_static).
  # Every dK/dV term is per key, so parts change only which program owns
  # a key and the shape of its dots: the sums agree with whole blocks up
  # to the order of f32 sums, whose last bit can round a bf16 cast of dS
  # the other way (a 2^-8 change of one term: far under 2e-4 here).
  args, run, want, (s, d) = _dkv_case(jnp.bfloat16, 64, 3, seed=5, sp=448)
  whole = run()
  for got, ref_, name in zip(whole, want, ('dk', 'dv')):
    lib.assert_close(got[:, :s, :, :d], ref_, 2e-2, name)
  for parts in (2, 4):
    for a, e, name in zip(run(key_parts=parts), whole, ('dk', 'dv')):
      lib.assert_close(a, e, 2e-4, f'{name}: {parts} parts vs whole')
  for bad in (0, 3, 128):  # no empty or uneven part
    with pytest.raises(ValueError, match='key_parts'):
      run(key_parts=bad)
  # Compiled for a GPU, no part under tl.dot's 16 keys (8 parts of 64).
  with pytest.raises(ValueError, match='at least 16 keys'):
    jax.eval_shape(functools.partial(
        kv_outer.dkv, block_size=64, scale=1.0, interpret=False,
        key_parts=8), *args)


# s = 120: the keys padded to whole blocks (a key-valid mask operand);
# 128: none. The length-9 row has one block: its other slots are -1.
@pytest.mark.parametrize('dtype,tol,s,tiled', [
    (jnp.float32, 1e-5, 120, False), (jnp.bfloat16, 2e-2, 128, False),
    (jnp.float32, 1e-5, 128, False), (jnp.float32, 1e-5, 120, True)])
def test_split_k_decode_equals_reference(dtype, tol, s, tiled):
  b, g, r, d, di, c, k = 3, 2, 3, 16, 8, 16, 4
  q, kk, v, qi, ki, _ = lib.make_inputs(b, 1, s, g, r, d, di, dtype=dtype)
  lengths = jnp.array([s, 61, 9])
  out, aux = jax.jit(functools.partial(
      pallas_path.msa_decode, block_size=c, top_k=k, backend='gpu',
      interpret=True,
      kv_config=kv_outer.ForwardConfig(tiled_decode=tiled)))(
          q[:, 0], kk, v, qi[:, 0], ki, lengths)
  f32 = lambda x: x.astype(jnp.float32)
  want, want_aux = ref.msa_attention(f32(q), f32(kk), f32(v), qi, ki,
                                     block_size=c, top_k=k,
                                     q_offset=lengths - 1)
  np.testing.assert_array_equal(aux['sel_BGK'], want_aux['sel_BGTK'][:, :, 0])
  lib.assert_close(out, want[:, 0], tol, 'out')
  lib.assert_close(aux['lse_BH'], want_aux['lse_BTH'][:, 0], tol, 'lse')


@pytest.mark.parametrize('dtype', [jnp.bfloat16, jnp.float32])
@lib.with_cuda_lowering
def test_kernels_lower_for_cuda(dtype):
  b, t, g, r, d, c, k = 1, 2048, 4, 16, 128, 128, 16
  shape = jax.ShapeDtypeStruct
  q = shape((b, t, g * r, d), dtype)
  kv = shape((b, t, g, d), dtype)
  sel = shape((b, g, t, k), jnp.int32)
  off = shape((b,), jnp.int32)

  def train(q, keys, values, sel, off):
    def loss(q, keys, values):
      out, _ = pallas_path.sparse_attention(q, keys, values, sel, off, c,
                                            'gpu', False)
      return out.astype(jnp.float32).sum()
    return jax.grad(loss, argnums=(0, 1, 2))(q, keys, values)

  text = jax.jit(train).trace(q, kv, kv, sel, off).lower(
      lowering_platforms=('cuda',)).as_text()
  for name in ('msa_kv_outer_forward', 'msa_kv_outer_dkv',
               'msa_backward_dq_gpu'):
    assert name in text, name
  assert 'msa_backward_gpu' not in text  # no atomics kernel
  # The forward's timed variants lower too (scatter stores, the prefetch
  # carry, other warp and stage counts).
  text = jax.jit(lambda q, keys, values, sel, off: pallas_path.sparse_backward(
      q, keys, values, sel, off, None, q, jnp.zeros(q.shape[:3], jnp.float32),
      q, None, block_size=c, backend='gpu', interpret=False, parts='dkv',
      dkv_prefetch=True)).trace(q, kv, kv, sel, off).lower(
          lowering_platforms=('cuda',)).as_text()
  assert 'msa_kv_outer_dkv' in text  # the dK/dV prefetch variant lowers
  for config in (kv_outer.ForwardConfig(pair_order=True, prefetch=True),
                 kv_outer.ForwardConfig(prefetch=True, num_warps=4,
                                        num_stages=3, q_per_tile=4),
                 kv_outer.ForwardConfig(pair_order=True, fused_combine=True)):
    fwd = lambda q, k_, v_, sel, off: pallas_path.sparse_forward(
        q, k_, v_, sel, off, None, block_size=c, backend='gpu',
        interpret=False, kv_config=config)
    text = jax.jit(fwd).trace(q, kv, kv, sel, off).lower(
        lowering_platforms=('cuda',)).as_text()
    assert 'msa_kv_outer_forward' in text, config.label()
    assert ('msa_kv_outer_combine' in text) == config.fused_combine
  decode = functools.partial(pallas_path.msa_decode, block_size=c, top_k=k,
                             backend='gpu', interpret=False)
  text = jax.jit(decode).trace(
      shape((8, g * r, d), dtype), shape((8, 32768, g, d), dtype),
      shape((8, 32768, g, d), dtype), shape((8, g, 128), dtype),
      shape((8, 32768, 128), dtype), shape((8,), jnp.int32)).lower(
          lowering_platforms=('cuda',)).as_text()
  for name in ('msa_index_scores', 'msa_index_topk', 'msa_kv_outer_decode',
               'msa_kv_outer_combine'):
    assert name in text, name
  assert 'msa_kv_outer_forward' not in text


def test_batched_chunk_plans_equal_chunk_by_chunk_plans():
  # forward_plan builds its whole query chunks' plans in one vmapped
  # computation: each equals build_tiles + work items of that chunk alone
  # (absolute tokens), and the remainder chunk is planned as before.
  (_, _, _, _, sel), (b, t, s, g, r, d, c, k, o) = _selection('ragged_chunk')
  sel = np.array(sel)
  sel[:, :, ::5, 0] = -1
  sel = jnp.asarray(sel)
  n_blocks = -(-s // c)
  size = 16
  assert t % size and t // size >= 2
  for pair_order in (False, True):
    config = kv_outer.ForwardConfig(query_chunk=size, q_per_tile=3,
                                    pair_order=pair_order)
    plan = jax.jit(functools.partial(
        kv_outer.forward_plan, n_blocks=n_blocks, heads_p=4, head_dim_p=16,
        dtype=jnp.float32, config=config))(sel)
    assert len(plan) == -(-t // size)
    for i, (items, rows, out_rows, pair) in enumerate(plan):
      t0 = i * size
      tiles = kv_outer.build_tiles(sel[:, :, t0:t0 + size],
                                   n_blocks=n_blocks, q_per_tile=3, t0=t0)
      want_items = kv_outer._work_items(
          tiles[0], n_blocks,
          kv_outer._per_program(tiles[0].shape[-1], n_blocks))[:3]
      for got, want in zip(items, want_items):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
      np.testing.assert_array_equal(
          np.asarray(rows),
          np.asarray(kv_outer.tile_rows(tiles[1], groups=g, heads_p=4)))
      np.testing.assert_array_equal(np.asarray(pair), np.asarray(tiles[2]))
      assert (out_rows is not None) == pair_order
