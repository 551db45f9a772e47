"""Per-expert load: counts from the foresight, the compact form, the images."""
import os

import numpy as np
import pytest

from foremoe_jax.foresight import expert_load, loads as loads_lib
from foremoe_jax.utils import metrics as metrics_lib
from foremoe_jax.utils import tensorboard


def _routes(rng, num_layers, num_samples, num_tokens, top_k, num_experts):
  """A routing record with distinct experts per token (as top-k gives)."""
  routes_LBTK = np.empty((num_layers, num_samples, num_tokens, top_k),
                         np.int32)
  for idx in np.ndindex(num_layers, num_samples, num_tokens):
    routes_LBTK[idx] = rng.choice(num_experts, top_k, replace=False)
  return routes_LBTK


def test_tokens_per_layer_and_expert_count_the_routing_record():
  rng = np.random.default_rng(0)
  num_layers, num_samples, num_tokens, top_k, num_experts = 3, 8, 5, 2, 6
  routes_LBTK = _routes(rng, num_layers, num_samples, num_tokens, top_k,
                        num_experts)
  valid_BT = rng.random((num_samples, num_tokens)) < 0.7
  counts_BLE = loads_lib.sample_expert_counts(routes_LBTK, valid_BT,
                                              num_experts)
  microbatches = [np.array([0, 3, 5, 6]), np.array([1, 2, 4, 7])]
  loads_MGLDE = loads_lib.loads_from_sample_counts(counts_BLE, microbatches,
                                                   d_data=2, d_ep=2)
  tokens_LE = expert_load.expert_tokens(loads_MGLDE)
  # Reference: a plain loop over the valid tokens of the record.
  want_LE = np.zeros((num_layers, num_experts), np.int64)
  for l, b, t in np.ndindex(num_layers, num_samples, num_tokens):
    if valid_BT[b, t]:
      for e in routes_LBTK[l, b, t]:
        want_LE[l, e] += 1
  np.testing.assert_array_equal(tokens_LE, want_LE)
  assert (tokens_LE.sum(1) == valid_BT.sum() * top_k).all()
  with pytest.raises(ValueError, match=r'\[M, G, L, D, E\]'):
    expert_load.expert_tokens(loads_MGLDE.sum(1))


def test_summary_by_hand():
  tokens_LE = np.array([[10, 10, 10, 10],   # uniform
                        [0, 30, 10, 0],     # hot expert 1, two unused
                        [5, 5, 0, 0],       # a tie: the lower id
                        [0, 0, 0, 0]])      # a layer with no token
  s = expert_load.summary(tokens_LE)
  assert s['expert_hot_share'] == [0.25, 0.75, 0.5, 0.0]
  assert s['expert_hot_id'] == [0, 1, 0, 0]
  assert s['expert_hot_share_max'] == 0.75
  assert s['expert_unused_frac'] == pytest.approx(8 / 16)


def test_heatmap_colours_hot_red_cold_blue_uniform_white():
  tokens_LE = np.array([[10, 10, 10, 10], [1, 37, 1, 1]])
  img = expert_load.heatmap_rgb(tokens_LE, cell_px=3)
  assert img.shape == (6, 12, 3) and img.dtype == np.uint8
  cell = lambda l, e: img[3 * l + 1, 3 * e + 1].astype(int)
  r, g, b = cell(1, 1)            # 3.7x the layer mean: red
  assert r > 150 and r > b + 80
  r, g, b = cell(1, 0)            # 0.1x: clipped at the coldest blue
  assert b > 80 and b > r + 60
  assert (cell(0, 2) > 225).all()  # uniform: (nearly) white
  # Every cell is cell_px pixels square.
  assert (img[3:6, 3:6] == cell(1, 1)).all()


def test_writer_files_tensorboard_and_plot(tmp_path):
  """Records go to expert_load.jsonl and TensorBoard (a histogram per layer,
  the heatmap image); the plot reads them back, the last record of a step
  winning as after a resume."""
  workdir = str(tmp_path)
  tb = tensorboard.TensorBoardWriter(workdir)
  w = metrics_lib.MetricsWriter(workdir, expert_load.EXPERT_LOAD_FILE,
                                mirror=tb)
  rng = np.random.default_rng(1)
  sent = {}
  for step in (1, 2, 3, 2):
    tokens_LE = rng.integers(0, 50, (2, 8))
    sent[step] = tokens_LE
    w.write(step, {'phase': 'rl', expert_load.TOKENS_KEY: tokens_LE})
  w.close()
  tb.close()
  steps_S, tokens_SLE = expert_load.read(workdir)
  assert steps_S.tolist() == [1, 2, 3]
  for i, s in enumerate(steps_S):
    np.testing.assert_array_equal(tokens_SLE[i], sent[s])
  events = b''.join(
      open(os.path.join(workdir, 'tensorboard', f), 'rb').read()
      for f in os.listdir(os.path.join(workdir, 'tensorboard')))
  for tag in (b'rl/expert_tokens/moe_layer_0', b'rl/expert_tokens/moe_layer_1',
              b'rl/expert_load_heatmap'):
    assert tag in events
  assert b'\x89PNG' in events  # The image is stored as an encoded PNG.
  path = expert_load.plot(workdir)
  with open(path, 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'
  assert expert_load.plot(str(tmp_path / 'empty')) is None
