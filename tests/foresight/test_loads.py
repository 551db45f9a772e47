"""Foresight loads against a literal loop over micro-batches, tokens and k."""
import numpy as np
import pytest

from foremoe_jax.foresight import loads
from foremoe_jax.foresight.loads import (microstep_group_loads,
                                         microstep_loads, sample_expert_counts,
                                         source_devices, step_loads)


def _loop_group_loads(routes, valid, microbatches, num_experts, d_data, d_ep):
  """[M, G, L, D, E] by a literal loop: shard = flat token // shard size on
  the data-major ('data', 'expert') mesh."""
  num_layers, _, num_tokens, top_k = routes.shape
  out = np.zeros((len(microbatches), d_data, num_layers, d_ep, num_experts),
                 np.int64)
  for m, idx in enumerate(microbatches):
    shard_size = len(idx) * num_tokens // (d_data * d_ep)
    for row, b in enumerate(idx):
      for t in range(num_tokens):
        if not valid[b, t]:
          continue
        shard = (row * num_tokens + t) // shard_size
        group, src = shard // d_ep, shard % d_ep
        for l in range(num_layers):
          for k in range(top_k):
            out[m, group, l, src, int(routes[l, b, t, k])] += 1
  return out


def _loop_loads(routes, valid, microbatches, num_experts, d_data, d_ep):
  return _loop_group_loads(routes, valid, microbatches, num_experts, d_data,
                           d_ep).sum(axis=1)


def _record(seed, num_layers=3, num_samples=8, num_tokens=6, top_k=2,
            num_experts=5, dtype=np.int32):
  rng = np.random.default_rng(seed)
  routes = rng.integers(0, num_experts, (num_layers, num_samples, num_tokens,
                                         top_k)).astype(dtype)
  valid = rng.random((num_samples, num_tokens)) < 0.8
  routes[:, ~valid] = -1  # Padding ids are garbage and must be ignored.
  return routes, valid


@pytest.mark.parametrize('dtype', [np.int8, np.int16, np.int32])
@pytest.mark.parametrize('d_data, d_ep', [(1, 1), (1, 4), (2, 2), (4, 1),
                                          (2, 3)])
@pytest.mark.parametrize('microbatches', [
    [[0, 1, 2, 3], [4, 5, 6, 7]],
    [[5, 2, 7, 0], [3, 6, 1, 4]],
    [[6, 1], [0, 3, 4, 5, 2, 7]],
])
def test_matches_loop(dtype, d_data, d_ep, microbatches):
  routes, valid = _record(0, dtype=dtype)
  got = microstep_loads(routes, valid, microbatches, 5, d_data, d_ep)
  want = _loop_loads(routes, valid, microbatches, 5, d_data, d_ep)
  assert got.dtype == np.int64 and got.shape == want.shape
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(
      step_loads(routes, valid, microbatches, 5, d_data, d_ep), want.sum(0))
  # Every valid assignment is counted exactly once.
  assert got.sum() == valid.sum() * routes.shape[0] * routes.shape[3]
  groups = microstep_group_loads(routes, valid, microbatches, 5, d_data, d_ep)
  np.testing.assert_array_equal(
      groups, _loop_group_loads(routes, valid, microbatches, 5, d_data, d_ep))


def test_hand_example():
  # One layer, top-1, 2 samples x 4 tokens; micro-batch [1, 0] on d_data=1,
  # d_ep=2: 8 tokens -> shards of 4, so sample 1 is on device 0 and sample 0
  # on device 1.
  routes = np.array([[[[0], [1], [1], [2]],
                      [[2], [2], [0], [3]]]], np.int8)
  valid = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], bool)
  got = microstep_loads(routes, valid, [np.array([1, 0])], 4, 1, 2)
  np.testing.assert_array_equal(got[0, 0], [[1, 0, 2, 1],    # device 0
                                            [1, 2, 0, 0]])   # device 1
  # With d_data=2, d_ep=2 shards are 2 tokens: [2, 2] [0, 3] [0, 1] [1, pad];
  # shards 0, 2 -> device 0 and shards 1, 3 -> device 1.
  got = microstep_loads(routes, valid, [np.array([1, 0])], 4, 2, 2)
  np.testing.assert_array_equal(got[0, 0], [[1, 1, 2, 0],
                                            [1, 1, 0, 1]])
  # Data group 0 holds shards 0, 1 (sample 1), group 1 shards 2, 3.
  got = microstep_group_loads(routes, valid, [np.array([1, 0])], 4, 2, 2)
  np.testing.assert_array_equal(got[0, :, 0], [[[0, 0, 2, 0],    # g0 dev 0
                                                [1, 0, 0, 1]],   # g0 dev 1
                                               [[1, 1, 0, 0],    # g1 dev 0
                                                [0, 1, 0, 0]]])  # g1 dev 1


def test_source_devices_layout():
  np.testing.assert_array_equal(source_devices(2, 4, 2, 2),
                                [[0, 0, 1, 1], [0, 0, 1, 1]])
  np.testing.assert_array_equal(source_devices(1, 6, 1, 3),
                                [[0, 0, 1, 1, 2, 2]])


def test_sample_expert_counts():
  routes, valid = _record(1)
  counts = sample_expert_counts(routes, valid, 5)
  assert counts.shape == (8, 3, 5)
  for b in range(8):
    for l in range(3):
      ids = routes[l, b][valid[b]].reshape(-1)
      np.testing.assert_array_equal(counts[b, l], np.bincount(ids, minlength=5))
  mbs = [[0, 1, 2, 3], [4, 5, 6, 7]]
  np.testing.assert_array_equal(
      step_loads(routes, valid, mbs, 5, 2, 2).sum(1), counts.sum(0))


def test_valid_defaults_to_all():
  routes, _ = _record(2)
  routes = np.abs(routes)
  all_valid = np.ones(routes.shape[1:3], bool)
  np.testing.assert_array_equal(
      microstep_loads(routes, None, [range(8)], 5, 1, 2),
      microstep_loads(routes, all_valid, [range(8)], 5, 1, 2))


def test_errors():
  routes, valid = _record(3)
  with pytest.raises(ValueError, match='divisible by 4'):
    microstep_loads(routes, valid, [[0], [1, 2, 3, 4, 5, 6, 7]], 5, 2, 2)
  bad = routes.copy()
  bad[0, 0, np.flatnonzero(valid[0])[0], 0] = 5
  with pytest.raises(ValueError, match='outside'):
    microstep_loads(bad, valid, [range(8)], 5, 1, 2)
  with pytest.raises(ValueError, match='sample ids outside'):
    microstep_loads(routes, valid, [[0, 8]], 5, 1, 2)
  with pytest.raises(ValueError, match='does not match'):
    microstep_loads(routes, valid[:, :-1], [range(8)], 5, 1, 2)


@pytest.mark.parametrize('d_data,d_ep', [(1, 4), (2, 2), (2, 4)])
def test_loads_from_sample_counts_equal_the_routes_count(d_data, d_ep):
  """With whole sequences on every device (the RL step's layout), summing
  per-sample counts gives exactly the loads counted token by token from the
  routing record, padding included."""
  rng = np.random.default_rng(d_data * 10 + d_ep)
  num_layers, num_samples, num_tokens, top_k, num_experts = 3, 32, 9, 2, 6
  routes = rng.integers(0, num_experts, (num_layers, num_samples, num_tokens,
                                         top_k))
  valid = rng.random((num_samples, num_tokens)) > 0.3
  mbs = np.split(rng.permutation(num_samples), 2)
  counts = sample_expert_counts(routes, valid, num_experts)
  np.testing.assert_array_equal(
      loads.loads_from_sample_counts(counts, mbs, d_data, d_ep),
      microstep_group_loads(routes, valid, mbs, num_experts, d_data, d_ep))
  with pytest.raises(ValueError, match='whole'):
    loads.loads_from_sample_counts(counts, np.split(np.arange(32), 8), 2, 4)
