"""NaN/Inf guard: the update names the micro-steps that went non-finite, and
the trainer stops on them without checkpointing the bad state."""
import importlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conftest

from foremoe_jax.rl import step as step_lib
from foremoe_jax.rl import trainer
import rl_testlib as lib


def test_update_flags_exactly_the_micro_steps_that_saw_a_nan():
  cfg = lib.mini_config()
  mesh, graphdef, params = lib.build(cfg)
  tx = step_lib.make_optimizer(1e-3, 1.0)
  state = step_lib.init_train_state(graphdef, params, tx, mesh, with_ref=False)
  num_mb = 4
  batch = lib.synthetic_batch(num_mb, seed=3)
  plan = lib.moving_plan(num_mb)
  grads = lib.grads_fn()
  _, m = grads(state, batch, plan)
  assert not np.asarray(m['nonfinite_M']).any()
  # A NaN reward poisons its GRPO group's advantages (samples 0..NUM_GEN-1),
  # so exactly the micro-batches holding one of them go non-finite.
  rewards = np.asarray(batch['rewards_B']).copy()
  rewards[1] = np.nan
  bad_batch = dict(batch, rewards_B=jnp.asarray(rewards))
  _, m = grads(state, bad_batch, plan)
  mbs = np.asarray(batch['microbatches_Mb'])
  expect = [int(any(s < lib.NUM_GEN for s in mb)) for mb in mbs]
  assert 0 < sum(expect) < num_mb  # The case tells micro-steps apart.
  np.testing.assert_array_equal(np.asarray(m['nonfinite_M']), expect)
  with pytest.raises(trainer.NonFiniteError) as e:
    trainer.check_finite(7, dict(m, grad_norm=jnp.float32(1.0)))
  bad = [i for i, x in enumerate(expect) if x]
  assert f'RL step 7: non-finite loss or gradient in micro-step(s) {bad} ' \
      f'of {num_mb}' in str(e.value)


def test_trainer_stops_on_a_nan_reward_without_checkpointing_it(tmp_path,
                                                                monkeypatch):
  # The programs other tests' runs share (conftest.SHARED_TINY_RUN).
  cfg = conftest.apply_shared_tiny_run(
      importlib.import_module('configs.tiny').get_config())
  cfg.warmstart.steps = 10
  cfg.rl.steps = 4
  cfg.checkpoint_every = 1
  cfg.eval_prompts = 0
  calls = []
  real_score = trainer.score

  def score(ctx, prompts, ro):  # The second RL step's verifier breaks.
    r = real_score(ctx, prompts, ro)
    calls.append(1)
    return np.full_like(r, np.nan) if len(calls) == 2 else r
  monkeypatch.setattr(trainer, 'score', score)
  with pytest.raises(trainer.NonFiniteError, match='RL step 2: '):
    trainer.train(cfg, str(tmp_path))
  ckpts = sorted(int(d) for d in os.listdir(tmp_path / 'checkpoints')
                 if d.isdigit())
  assert ckpts[-1] == 1, ckpts  # Step 1 is saved, step 2 is not.
  steps = [l for l in open(tmp_path / 'metrics.jsonl')]
  assert len(steps) == 1
