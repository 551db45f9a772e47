"""model.remat_policy: the same gradients under every policy, and less kept
for the backward pass the less the policy saves."""
import importlib

import jax
import numpy as np

from foremoe_jax import config as config_lib
from foremoe_jax.benchmarks import remat
from foremoe_jax.model import expert_parallel as ep


def test_every_policy_gives_the_same_gradients_and_full_saves_memory():
  cfg = importlib.import_module('configs.tiny_msa').get_config().model
  tokens = jax.random.randint(jax.random.key(1), (16, 33), 0, cfg.vocab_size)
  r = remat.report(cfg, ep.make_mesh(1, 8), tokens)
  assert set(r) == set(config_lib.REMAT_POLICIES)
  for policy, row in r.items():
    assert row['grad_max_abs_diff_vs_none'] <= 1e-6, (policy, row)
    np.testing.assert_allclose(row['loss'], r['none']['loss'], rtol=1e-6)
    assert row['temp_bytes'] > 0
  # What the forward keeps for the backward shrinks as the policy keeps
  # less: full (block inputs) < minimal (+ projections) < dots (+ batched
  # dots) < none (everything).
  saved = [r[p]['saved_residual_bytes'] for p in ('full', 'minimal', 'dots',
                                                  'none')]
  assert saved == sorted(set(saved)), r
  assert saved[0] < saved[-1] / 4, r
  # The report reads the residuals off the pullback; jax's own printer of
  # them, which traces the model again, gives the same bytes.
  cfg.remat_policy = 'minimal'
  assert remat.saved_residual_bytes(cfg, ep.make_mesh(1, 8), tokens) == (
      r['minimal']['saved_residual_bytes'])


def test_dense_attention_blocks_are_rematerialised_too():
  cfg = importlib.import_module('configs.tiny').get_config().model
  tokens = jax.random.randint(jax.random.key(1), (8, 17), 0, cfg.vocab_size)
  mesh = ep.make_mesh(1, 8)
  saved = {}
  for policy in ('none', 'full'):
    cfg.remat_policy = policy
    saved[policy] = remat.saved_residual_bytes(cfg, mesh, tokens)
  assert saved['full'] < saved['none'] / 2, saved
