"""The MSA benchmark's baselines and formulas against independent references."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.msa import benchmark, reference


def _qkv(b, t, g, r, d, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  n = jax.random.normal
  return (n(ks[0], (b, t, g * r, d)), n(ks[1], (b, t, g, d)),
          n(ks[2], (b, t, g, d)))


@pytest.mark.parametrize('chunk', [64, 128, 512])
def test_causal_dense_equals_masked_attention(chunk):
  q, k, v = _qkv(2, 512, 2, 3, 32)
  out = jax.jit(functools.partial(benchmark.causal_dense, chunk=chunk))(q, k, v)
  want = reference.dense_causal_attention(q, k, v)
  np.testing.assert_allclose(out, want, atol=2e-6, rtol=1e-5)


def test_causal_dense_never_reads_keys_above_the_diagonal():
  # NaN keys/values past the first chunk: a flash-style loop never touches
  # them for the first chunk's queries; a masked square would propagate NaN
  # through 0 * NaN in p @ v.
  q, k, v = _qkv(1, 256, 1, 2, 16)
  k = k.at[:, 64:].set(jnp.nan)
  v = v.at[:, 64:].set(jnp.nan)
  out = benchmark.causal_dense(q, k, v, chunk=64)
  assert np.isfinite(np.asarray(out[:, :64])).all()
  want = reference.dense_causal_attention(q[:, :64], k[:, :64], v[:, :64])
  np.testing.assert_allclose(out[:, :64], want, atol=2e-6)


def test_causal_dense_rejects_ragged_length():
  q, k, v = _qkv(1, 100, 1, 1, 8)
  with pytest.raises(ValueError, match='multiple of chunk'):
    benchmark.causal_dense(q, k, v, chunk=64)


def test_dense_decode_equals_last_row_of_causal_attention():
  b, s, g, r, d = 3, 96, 2, 2, 16
  q, k, v = _qkv(b, s, g, r, d, seed=1)
  lengths = jnp.array([96, 40, 1], jnp.int32)
  got = benchmark.dense_decode(q[:, 0], k, v, lengths)
  for i, n in enumerate(np.asarray(lengths)):
    # The decode token at position n-1 sees keys 0..n-1.
    want = reference.dense_causal_attention(
        q[i:i + 1, :1], k[i:i + 1, :n], v[i:i + 1, :n], q_offset=n - 1)
    np.testing.assert_allclose(got[i], want[0, 0], atol=2e-6)


def test_gqa_dense_decodes_equal_jax_nn_decode():
  # Lengths cut inside the cache (padding keys masked), three groups of
  # four heads, so a wrong head-to-group mapping shows.
  b, s, g, r, d = 3, 96, 3, 4, 16
  q, k, v = _qkv(b, s, g, r, d, seed=2)
  lengths = jnp.array([96, 40, 1], jnp.int32)
  want = benchmark.dense_decode(q[:, 0], k, v, lengths)
  for fn in (benchmark.grouped_dense_decode, benchmark.rows_dense_decode):
    np.testing.assert_allclose(fn(q[:, 0], k, v, lengths), want, atol=2e-6,
                               err_msg=fn.__name__)


def test_decode_flop_ratio_by_hand():
  # r=4, D=128, dI=128, K*B = 16*128 = 2048 at n = 8192:
  # dense 4*4*128*8192; MSA 2*128*8192 + 4*4*128*2048.
  want = (4 * 4 * 128 * 8192) / (2 * 128 * 8192 + 4 * 4 * 128 * 2048)
  got = benchmark.decode_flop_ratio(r=4, d=128, di=128, block=128, k=16,
                                    n=8192)
  assert got == pytest.approx(want)
  # A cache shorter than K*B: MSA reads it all, plus the index branch.
  short = benchmark.decode_flop_ratio(r=4, d=128, di=128, block=128, k=16,
                                      n=1024)
  assert short == pytest.approx(4 * 4 * 128 / (2 * 128 + 4 * 4 * 128))


def test_run_decode_row_shape_and_consistency():
  cfg = benchmark.MSABench(groups=2, heads_per_group=2, head_dim=16,
                           index_dim=16, block_size=16, top_k=2, repeats=1,
                           decode_batch=4)
  row = benchmark.run_decode(cfg, 256)
  assert row['cache_len'] == 256 and row['batch'] == 4
  # speedup is against the faster dense decode of the two, both timed.
  times = {name: row[f'{name}_s']
           for name in ('dense', 'grouped_dense', 'rows_dense')}
  best = min(times.values())
  assert times[row['strongest_dense']] == best
  assert row['speedup'] == pytest.approx(best / row['msa_s'], rel=1e-2)
  assert row['speedup_vs_jax_nn'] == pytest.approx(
      row['dense_s'] / row['msa_s'], rel=1e-2)
  assert set(row['spread']) == {'dense', 'grouped_dense', 'rows_dense',
                                'msa'}
  assert row['flop_ratio'] == pytest.approx(benchmark.decode_flop_ratio(
      r=2, d=16, di=16, block=16, k=2, n=256), abs=1e-3)
