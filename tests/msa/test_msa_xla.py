"""The XLA (CPU) path against the reference: same API, same numbers."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import msa_testlib as lib
from pallas_kernels.msa import reference as ref
from pallas_kernels.msa import xla

# Small tiles so a short test still spans several tiles and loop steps.
SMALL = dict(pairs_per_tile=8, tiles_per_step=4)


def _loss(attn, w):
  def f(q, k, v):
    out, lse = attn(q, k, v)
    return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(jnp.sin(lse))
  return f


@pytest.mark.parametrize('name', sorted(lib.SHAPES))
def test_selection_and_forward_match_reference(name):
  b, t, s, g, r, d, di, c, k, o = lib.SHAPES[name]
  q, kk, v, qi, ki, _ = lib.make_inputs(b, t, s, g, r, d, di)
  scores = xla.block_scores_BGTN(qi, ki, block_size=c, q_offset=o,
                                 q_chunk=16, k_chunk=32)
  want_scores = ref.block_scores_BGTN(ref.index_logits_BGTS(qi, ki, o), c)
  np.testing.assert_array_equal(np.isinf(scores), np.isinf(want_scores))
  lib.assert_close(jnp.where(jnp.isinf(scores), 0, scores),
                   jnp.where(jnp.isinf(want_scores), 0, want_scores), 1e-5)
  kw = dict(block_size=c, top_k=k, q_offset=o)
  out, aux = jax.jit(functools.partial(xla.msa_attention, **kw))(
      q, kk, v, qi, ki)
  want, want_aux = jax.jit(functools.partial(ref.msa_attention, **kw))(
      q, kk, v, qi, ki)
  np.testing.assert_array_equal(lib.as_sets(aux['sel_BGTK']),
                                lib.as_sets(want_aux['sel_BGTK']))
  lib.check_selection_invariants(aux['sel_BGTK'], c, o)
  lib.assert_close(out, want, 1e-5, 'out')
  lib.assert_close(aux['lse_BTH'], want_aux['lse_BTH'], 1e-5, 'lse')


@pytest.mark.parametrize('dtype,tol', [(jnp.float32, 1e-5),
                                       (jnp.bfloat16, 2e-2)])
def test_forward_and_gradients_match_reference(dtype, tol):
  b, t, s, g, r, d, di, c, k, o = lib.SHAPES['ragged_chunk']
  q, kk, v, qi, ki, w = lib.make_inputs(b, t, s, g, r, d, di, dtype=dtype)
  sel = ref.selection_BGTK(qi, ki, block_size=c, top_k=k, q_offset=o)
  fast = functools.partial(xla.sparse_attention, sel_BGTK=sel, block_size=c,
                           q_offset=o, **SMALL)
  slow = functools.partial(ref.sparse_attention, sel_BGTK=sel, block_size=c,
                           q_offset=o)
  got, want = jax.jit(fast)(q, kk, v), jax.jit(slow)(q, kk, v)
  lib.assert_close(got[0], want[0], tol, 'out')
  lib.assert_close(got[1], want[1], tol, 'lse')
  g_fast = jax.jit(jax.grad(_loss(fast, w), argnums=(0, 1, 2)))(q, kk, v)
  g_slow = jax.jit(jax.grad(_loss(slow, w), argnums=(0, 1, 2)))(q, kk, v)
  for name, a, e in zip('qkv', g_fast, g_slow):
    lib.assert_close(a, e, tol, f'd{name}')


def _check_sparse_against_reference(q, kk, v, w, sel, c, o, **tiles):
  """xla.sparse_attention = the reference: out, lse and their gradients."""
  fast = functools.partial(xla.sparse_attention, sel_BGTK=sel, block_size=c,
                           q_offset=o, **tiles)
  slow = functools.partial(ref.sparse_attention, sel_BGTK=sel, block_size=c,
                           q_offset=o)
  got, want = jax.jit(fast)(q, kk, v), slow(q, kk, v)
  lib.assert_close(got[0], want[0], 1e-5, 'out')
  lib.assert_close(got[1], want[1], 1e-5, 'lse')
  g_fast = jax.jit(jax.grad(_loss(fast, w), argnums=(0, 1, 2)))(q, kk, v)
  g_slow = jax.grad(_loss(slow, w), argnums=(0, 1, 2))(q, kk, v)
  for name, a, e in zip('qkv', g_fast, g_slow):
    lib.assert_close(a, e, 1e-5, f'd{name}')


@pytest.mark.parametrize('pairs_per_tile,tiles_per_step', [(1, 1), (3, 5),
                                                          (64, 2)])
def test_merge_in_place_any_tile_size_matches_reference(pairs_per_tile,
                                                        tiles_per_step):
  # Tiles merge into their tokens' rows. One lane a tile and a step (every
  # pair its own step); 3 lanes (most tiles part-filled: spare rows take the
  # empty lanes), 5 tiles a step (a step's tiles share tokens, merged in
  # turn; the steps past the last filled tile are skipped); 64 lanes (more
  # than most blocks' pairs). All give the reference's numbers and
  # gradients.
  b, t, s, g, r, d, di, c, k, o = lib.SHAPES['ragged_chunk']
  q, kk, v, qi, ki, w = lib.make_inputs(b, t, s, g, r, d, di)
  sel = ref.selection_BGTK(qi, ki, block_size=c, top_k=k, q_offset=o)
  _check_sparse_against_reference(q, kk, v, w, sel, c, o,
                                  pairs_per_tile=pairs_per_tile,
                                  tiles_per_step=tiles_per_step)


@pytest.mark.parametrize('floats_per_group,batched', [(1 << 40, False),
                                                      (1, True)])
def test_map_groups_vmaps_only_more_than_one_group(floats_per_group,
                                                   batched):
  # One group a step must run unbatched: a batch of one would turn the tile
  # loop's dynamic slices into gathers (1.8x slower at 16k). The probe's
  # dynamic_slice stays one only when the map does not vmap it.
  def probe(args):
    x_N, i = args
    return jax.lax.dynamic_slice_in_dim(x_N, i, 2).sum()

  x_GN = jnp.arange(24.0).reshape(4, 6)
  i_G = jnp.array([0, 1, 2, 4])
  fn = lambda x, i: xla.map_groups(probe, (x, i), floats_per_group)
  jaxpr = str(jax.make_jaxpr(fn)(x_GN, i_G))
  assert ('gather' in jaxpr) == batched
  want = [float(x_GN[j, i:i + 2].sum()) for j, i in enumerate([0, 1, 2, 4])]
  np.testing.assert_allclose(jax.jit(fn)(x_GN, i_G), want)


def test_pack_pairs_key_sort_equals_argsort(monkeypatch):
  # The one-key sort (block * P + pair) and the argsort it replaces where
  # the key would overflow int32 pack the same tiles.
  sel_TK = jnp.asarray(np.random.default_rng(0).integers(-1, 9, (50, 4)),
                       jnp.int32)
  n_tiles = xla.tile_shape(200, 9, 4, 1)[2]
  want = xla.pack_pairs(sel_TK, 9, n_tiles, 4)
  monkeypatch.setattr(xla, 'SORT_KEY_LIMIT', 0)
  got = xla.pack_pairs(sel_TK, 9, n_tiles, 4)
  for a, e in zip(got, want):
    np.testing.assert_array_equal(a, e)
  table_MQ, block_M, _ = want
  # Every real pair sits in exactly one lane of a tile of its own block.
  pairs = np.asarray(table_MQ)[np.asarray(table_MQ) < 200]
  assert sorted(pairs) == [i for i in range(200) if sel_TK.reshape(-1)[i] >= 0]
  rows, _ = np.nonzero(np.asarray(table_MQ) < 200)
  np.testing.assert_array_equal(np.asarray(block_M)[rows],
                                np.asarray(sel_TK).reshape(-1)[pairs])


def test_selection_without_own_block_or_with_a_later_one_matches_reference():
  # The own block takes the diagonal pass and the other blocks the unmasked
  # tiles; a selection may lack the own block (those tokens get no
  # diagonal partial) or name a later block (no key of it is visible).
  # Offset 60 with blocks of 16: the chunk starts mid-block.
  b, t, s, g, r, d, di, c, k, o = lib.SHAPES['ragged_chunk']
  q, kk, v, qi, ki, w = lib.make_inputs(b, t, s, g, r, d, di)
  sel = np.array(ref.selection_BGTK(qi, ki, block_size=c, top_k=k,
                                    q_offset=o))
  own_T = (o + np.arange(t)) // c
  n_blocks = -(-s // c)
  for tt in range(t):
    own = sel[:, :, tt] == own_T[tt]
    if tt % 3 == 0:
      sel[:, :, tt][own] = -1
    elif tt % 3 == 1 and own_T[tt] + 1 < n_blocks:
      sel[:, :, tt][own] = own_T[tt] + 1
  assert (sel == own_T[None, None, :, None]).any(-1).mean() < 0.75
  _check_sparse_against_reference(q, kk, v, w, jnp.asarray(sel), c, o,
                                  **SMALL)


def test_shuffled_and_padded_selection_changes_nothing():
  b, t, s, g, r, d, di, c, k, o = lib.SHAPES['gqa']
  q, kk, v, qi, ki, _ = lib.make_inputs(b, t, s, g, r, d, di)
  sel = ref.selection_BGTK(qi, ki, block_size=c, top_k=k, q_offset=o)
  perm = np.random.default_rng(1).permutation(k)
  padded = jnp.concatenate([-jnp.ones_like(sel[..., :2]), sel[..., perm]], -1)
  attn = jax.jit(functools.partial(xla.sparse_attention, block_size=c,
                                   q_chunk=32, **SMALL))
  a, z = attn(q, kk, v, sel), attn(q, kk, v, padded)
  lib.assert_close(z[0], a[0], 1e-6)
  lib.assert_close(z[1], a[1], 1e-6)


def test_full_budget_equals_dense_causal_gqa():
  b, t, s, g, r, d, di, c, _, o = lib.SHAPES['ragged_chunk']
  q, k, v, qi, ki, _ = lib.make_inputs(b, t, s, g, r, d, di)
  out, _ = jax.jit(functools.partial(
      xla.msa_attention, block_size=c, top_k=-(-s // c) + 2, q_offset=o))(
          q, k, v, qi, ki)
  lib.assert_close(out, ref.dense_causal_attention(q, k, v, o), 1e-5)


def test_decode_equals_last_row_of_prefill():
  b, s, g, r, d, di, c, k = 3, 100, 2, 2, 16, 8, 16, 3
  q, kk, v, qi, ki, _ = lib.make_inputs(b, s, s, g, r, d, di)
  lengths = np.array([100, 37, 1])  # not multiples of the block size
  out, aux = jax.jit(functools.partial(xla.msa_decode, block_size=c, top_k=k))(
      q[np.arange(b), lengths - 1], kk, v, qi[np.arange(b), lengths - 1], ki,
      jnp.asarray(lengths))
  for i, n in enumerate(lengths):
    # A full prefill of the first n tokens; its last row is the decode step.
    row, row_aux = jax.jit(functools.partial(
        ref.msa_attention, block_size=c, top_k=k))(
            q[i:i + 1, :n], kk[i:i + 1, :n], v[i:i + 1, :n], qi[i:i + 1, :n],
            ki[i:i + 1, :n])
    row, row_aux = row[:, -1:], {kk_: x[:, -1:] if kk_ == 'lse_BTH'
                                 else x[:, :, -1:]
                                 for kk_, x in row_aux.items()}
    lib.assert_close(out[i], row[0, 0], 1e-5, f'seq {i}')
    lib.assert_close(aux['lse_BH'][i], row_aux['lse_BTH'][0, 0], 1e-5)
    np.testing.assert_array_equal(aux['sel_BGK'][i], row_aux['sel_BGTK'][0, :, 0])


def test_indexer_kl_loss_and_gradients_match_reference():
  from pallas_kernels.msa import indexer_loss
  b, t, s, g, r, d, di, c, k, o = lib.SHAPES['ragged_chunk']
  q, kk, v, qi, ki, _ = lib.make_inputs(b, t, s, g, r, d, di)
  _, aux = ref.msa_attention(q, kk, v, qi, ki, block_size=c, top_k=k,
                             q_offset=o)
  fast = lambda qi, ki: indexer_loss.indexer_kl_loss(
      q, kk, qi, ki, aux['sel_BGTK'], aux['lse_BTH'], block_size=c,
      q_offset=o, pairs_per_tile=8, tiles_per_step=4)
  slow = lambda qi, ki: ref.indexer_kl_loss(q, kk, qi, ki, aux['sel_BGTK'],
                                            block_size=c, q_offset=o)
  l_fast, g_fast = jax.jit(jax.value_and_grad(fast, argnums=(0, 1)))(qi, ki)
  l_slow, g_slow = jax.jit(jax.value_and_grad(slow, argnums=(0, 1)))(qi, ki)
  lib.assert_close(l_fast, l_slow, 1e-5, 'loss')
  for a, e in zip(g_fast, g_slow):
    lib.assert_close(a, e, 1e-5, 'grad')


@pytest.mark.parametrize('di', [8, 128])
def test_exact_ties_go_to_the_lower_block_as_in_the_reference(di):
  """Index scores that tie exactly (entries in {-1, -.5, 0, .5, 1}) at a
  width whose 1/sqrt(I) is inexact: the prefill selects as the reference
  and as decode at each position (lower block id first). With the scale
  folded into the queries the XLA prefill broke ties by rounding (I = 128:
  2 of 192 rows, outputs O(1) apart from decode's)."""
  b, t, g, r, d, c, k = 2, 48, 2, 2, 8, 8, 3
  qi, ki = lib.exact_index_inputs(b, t, t, g, di, seed=1)
  qi, ki = qi.astype(jnp.float32), ki.astype(jnp.float32)
  want = lib.brute_force_selection(qi, ki, c, k, 0)
  scores = xla.block_scores_BGTN(qi, ki, block_size=c)
  got = xla.select_blocks_BGTK(scores, block_size=c, top_k=k)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_allclose(
      scores, ref.block_scores_BGTN(ref.index_logits_BGTS(qi, ki),
                                    block_size=c), rtol=1e-6)
