"""One GRPO step of the tiny config (dense, and with MSA) on one NVIDIA GPU.

Run by `make gpu-check`; skipped without a GPU. Sample with the routing
record, recompute log-probs with replayed routes (they must equal the
sampler's: the independent check), then one rl_step over 4 micro-steps,
each with its own placement, through the public make_rl_step.
"""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import gpu_rehearsal
from foremoe_jax import placement as placement_lib
from foremoe_jax.model import expert_parallel as ep
from foremoe_jax.model import sharding, transformer
from foremoe_jax.rl import step as step_lib
from foremoe_jax.planner.topology import Topology
from foremoe_jax.rl import trainer
from foremoe_jax.rollout import sampler as sampler_lib
from foremoe_jax.tasks import get_task
from foremoe_jax.transfer import schedule

pytestmark = pytest.mark.gpu


def test_tiny_rl_step_on_gpu():
  _one_rl_step(importlib.import_module('configs.tiny').get_config(),
               get_task('addition'))


def test_tiny_msa_rl_step_on_gpu():
  """The same with MiniMax Sparse Attention from layer 1 on: the Triton
  kernels in the sampler (prefill, split-K decode), in the log-prob check,
  and per device inside the step's shard_map (recompute and update). The
  sort task's 33-token sequences span 3 key blocks of 16, so top-2 is
  sparse for the last block's queries."""
  cfg = importlib.import_module('configs.tiny_msa').get_config()
  cfg.model.msa_block_size = 16  # The Triton kernels' smallest tile.
  cfg.model.max_seq_len = 64
  _one_rl_step(cfg, get_task('sort', num_digits=15))


def _one_rl_step(cfg, task):
  assert gpu_rehearsal.platform() == 'gpu'
  num_layers, num_experts = cfg.model.num_layers, cfg.model.num_experts
  mesh = ep.make_mesh(1, 1)
  with jax.default_matmul_precision('highest'):
    model = transformer.Transformer(cfg.model, mesh, rngs=nnx.Rngs(3))
    graphdef, params = sharding.split_model(model, mesh)
    sp = sampler_lib.SamplingParams(max_new_tokens=task.completion_len,
                                    num_generations=4)
    sampler = sampler_lib.Sampler(graphdef, cfg.model, mesh, sp)
    rollout = sampler(params, task.sample_prompts(0, 8), jax.random.key(0))
    rewards = np.random.default_rng(0).random(32).astype(np.float32)
    batch = trainer.rl_batch_from_rollout(rollout, rewards,
                                          np.split(np.arange(32), 4))

    whole = trainer.rl_batch_from_rollout(rollout, rewards, [np.arange(32)])
    logp, _ = jax.jit(lambda p, b: step_lib.token_logp(
        graphdef, p, b['tokens_MbT'][0], b['valid_MbT'][0], None,
        b['routes_MLbTK'][0], None))(params, whole)
    mask = whole['loss_mask_MbT'][0] > 0
    assert mask.sum() > 32
    np.testing.assert_allclose(np.asarray(logp)[mask],
                               whole['rollout_logp_MbT'][0][mask], atol=1e-4)

    tx = step_lib.make_optimizer(1e-2, 1.0)
    state = step_lib.init_train_state(
        graphdef, jax.tree.map(jnp.copy, params), tx, mesh, with_ref=True)
    rl_step = step_lib.make_rl_step(tx, num_generations=4, eps_low=0.2,
                                    eps_high=0.28, beta=0.01)
    # One EP device holds every slot: 2 per expert, the second a replica
    # that takes a random share of its expert's tokens.
    rng = np.random.default_rng(1)
    spd = 2 * num_experts
    placements = []
    for _ in range(4):
      se = np.tile(np.arange(num_experts, dtype=np.int32), 2)
      first = rng.random((num_layers, num_experts)).astype(np.float32)
      share = np.concatenate([first, 1.0 - first], axis=1)[:, None]
      placements.append(placement_lib.Placement(
          np.broadcast_to(se, (num_layers, spd)).copy(), share))
      placement_lib.validate_placement(placements[-1], num_experts, spd)
    before = jax.tree.map(np.asarray, state.params)
    plan = step_lib.make_step_plan(
        placement_lib.stack_placements(placements), num_experts,
        Topology(1, 1, spd), schedule.TransferBudget(1, 1))
    state, metrics = rl_step(state, batch, plan)
    assert int(metrics['transfer_id_errors']) == 0
    jax.block_until_ready(state)
  assert int(state.step) == 1
  for key in ('loss', 'grad_norm'):
    assert np.isfinite(float(metrics[key])), (key, metrics[key])
  assert float(metrics['grad_norm']) > 0
  moved = [not np.allclose(a, b) for a, b in
           zip(jax.tree.leaves(before), jax.tree.leaves(state.params))]
  assert all(moved)
