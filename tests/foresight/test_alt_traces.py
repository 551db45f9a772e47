"""Zipf + Dirichlet traces (foresight.alt_traces): conservation, exact top-k
per token, the skew knobs, determinism. numpy only, a few seconds."""
import dataclasses

import numpy as np
import pytest

from foremoe_jax.foresight import alt_traces, traces

SMALL = alt_traces.ZipfDirichletConfig(
    num_steps=2, num_microsteps=3, num_layers=2, num_experts=32, top_k=4,
    num_devices=4, tokens_per_device=256, seqs_per_device=2)


def _trace(**kw):
  return alt_traces.zipf_dirichlet_trace(dataclasses.replace(SMALL, **kw))


@pytest.mark.parametrize('concentration', [0.3, 3.0, 30.0])
@pytest.mark.parametrize('top_k', [1, 4, 32])
def test_loads_conserve_tokens_and_each_token_picks_distinct_experts(
    concentration, top_k):
  cfg = dataclasses.replace(SMALL, concentration=concentration, top_k=top_k)
  trace = alt_traces.zipf_dirichlet_trace(cfg)
  x = trace.loads_RMLDE
  assert isinstance(trace, traces.Trace)
  assert x.dtype == np.int64 and x.shape == (2, 3, 2, 4, 32)
  assert x.min() >= 0
  # Every (step, micro-step, layer, device) row: tokens x top_k selections.
  np.testing.assert_array_equal(x.sum(axis=-1), 256 * top_k)
  # An expert gets at most one selection per token.
  assert x.max() <= 256
  if top_k == 32:  # Every token takes every expert once.
    np.testing.assert_array_equal(x, 256)
  assert trace.meta['source'] == 'alt:zipf_dirichlet'
  assert trace.meta['top_k'] == top_k


def test_topk_counts_per_sequence_bounds():
  rng = np.random.default_rng(0)
  p_E = alt_traces.zipf_popularity(1, 16, 1.0, rng)[0]
  logq_QE = alt_traces.sequence_log_distributions(p_E, 0.3, 50, rng)
  tokens_Q = rng.integers(1, 40, 50)
  counts_QE = alt_traces.topk_counts(logq_QE, tokens_Q, 5, rng)
  np.testing.assert_array_equal(counts_QE.sum(axis=1), tokens_Q * 5)
  assert (counts_QE <= tokens_Q[:, None]).all()
  # Each sequence covers at least top_k experts.
  assert ((counts_QE > 0).sum(axis=1) >= 5).all()


def _inclusion_top2(q):
  """P(expert in a token's 2 picks) under successive sampling."""
  q = np.asarray(q, np.float64)
  return np.array([q[e] + sum(q[i] * q[e] / (1 - q[i])
                              for i in range(q.size) if i != e)
                   for e in range(q.size)])


def test_topk_counts_is_successive_sampling():
  """Inclusion frequencies of 2 picks without replacement match the exact
  ones within 5 sigma."""
  q = np.array([0.5, 0.3, 0.15, 0.05])
  n = 100_000
  counts = alt_traces.topk_counts(np.log(q)[None], np.array([n]), 2,
                                  np.random.default_rng(1))[0]
  want = _inclusion_top2(q)
  sigma = np.sqrt(want * (1 - want) / n)
  assert (np.abs(counts / n - want) < 5 * sigma).all(), (counts / n, want)


def test_topk_counts_orders_masses_below_float64():
  """Masses far below float64's range still decide the later picks: expert
  0 takes ~all first picks, then the rest in the ratio e^0 : e^-1 : e^-100."""
  logq = np.array([[0.0, -800.0, -801.0, -900.0]])
  n = 40_000
  counts = alt_traces.topk_counts(logq, np.array([n]), 2,
                                  np.random.default_rng(2))[0]
  assert counts[0] == n and counts[3] == 0
  p1 = 1 / (1 + np.exp(-1.0))
  assert abs(counts[1] / n - p1) < 5 * np.sqrt(p1 * (1 - p1) / n)
  # Three picks: every token takes experts 0, 1 and 2.
  counts = alt_traces.topk_counts(logq, np.array([1000]), 3,
                                  np.random.default_rng(3))[0]
  np.testing.assert_array_equal(counts, [1000, 1000, 1000, 0])


def test_lower_concentration_gives_more_microstep_skew():
  """Per-micro-step max/mean of the expert loads, averaged over seeds:
  c=0.3 > c=3 > c=30, each by > 10%."""
  cfg = alt_traces.ZipfDirichletConfig(
      num_steps=1, num_microsteps=4, num_layers=2, num_experts=64, top_k=2,
      num_devices=4, tokens_per_device=512, zipf_exponent=0.6)
  skew = {c: np.mean([alt_traces.microstep_expert_skew(
      alt_traces.zipf_dirichlet_trace(dataclasses.replace(
          cfg, concentration=c, seed=seed)).step(0)) for seed in range(6)])
          for c in (0.3, 3.0, 30.0)}
  assert skew[0.3] > 1.1 * skew[3.0] > 1.21 * skew[30.0], skew


def test_zipf_exponent_orders_the_hottest_expert_share():
  cfg = dataclasses.replace(SMALL, num_experts=64, top_k=2, num_layers=3,
                            concentration=30.0)
  share = {s: float(np.mean([traces.hottest_expert_share(t.step(r))
                             for r in range(t.num_steps)]))
           for s in (0.6, 1.0, 1.4)
           for t in [alt_traces.zipf_dirichlet_trace(
               dataclasses.replace(cfg, zipf_exponent=s))]}
  assert share[0.6] * 1.5 < share[1.0] and share[1.0] * 1.3 < share[1.4], share
  # The popularity itself: rank i gets i^-s, ranks permuted per layer.
  p_LE = alt_traces.zipf_popularity(3, 8, 1.0, np.random.default_rng(0))
  np.testing.assert_allclose(p_LE.sum(axis=1), 1)
  w = 1 / np.arange(1, 9)
  for p_E in p_LE:
    np.testing.assert_allclose(np.sort(p_E)[::-1], w / w.sum())
  assert len({tuple(np.argsort(p_E)) for p_E in p_LE}) > 1


def test_deterministic_by_seed():
  a, b, c = _trace(seed=5), _trace(seed=5), _trace(seed=6)
  np.testing.assert_array_equal(a.loads_RMLDE, b.loads_RMLDE)
  assert a.meta == b.meta
  assert not np.array_equal(a.loads_RMLDE, c.loads_RMLDE)


def test_split_tokens_and_validation():
  rng = np.random.default_rng(0)
  for total, parts in ((2048, 2), (7, 7), (100, 3)):
    got = alt_traces.split_tokens(total, parts, 0.5, rng)
    assert got.sum() == total and got.min() >= 1 and got.size == parts
  np.testing.assert_array_equal(alt_traces.split_tokens(10, 2, 0.0, rng),
                                [5, 5])
  with pytest.raises(ValueError, match='top_k'):
    dataclasses.replace(SMALL, top_k=33)
  with pytest.raises(ValueError, match='concentration'):
    dataclasses.replace(SMALL, concentration=0.0)
  with pytest.raises(ValueError, match='tokens_per_device'):
    dataclasses.replace(SMALL, tokens_per_device=1)
