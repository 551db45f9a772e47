"""Every config-validation rule rejects a bad config with a message naming it."""
import importlib

import numpy as np
import pytest

from foremoe_jax import config as config_lib


def tiny():
  return importlib.import_module('configs.tiny').get_config()


@pytest.mark.parametrize('name', ['tiny', 'tiny_msa', 'qwen3_30b_a3b', 'mixtral_8x7b',
                                  'olmoe_1b_7b'])
def test_shipped_configs_validate(name):
  config_lib.validate_config(importlib.import_module(f'configs.{name}').get_config())


BAD = [
    ('model.d_model', lambda c: setattr(c.model, 'd_model', 0), 'positive'),
    ('model.num_heads', lambda c: setattr(c.model, 'num_heads', 5), 'divisible by num_kv_heads'),
    ('model.head_dim', lambda c: setattr(c.model, 'head_dim', 15), 'even'),
    ('model.top_k', lambda c: setattr(c.model, 'top_k', 9), 'top_k'),
    ('model.first_dense_layers', lambda c: setattr(c.model, 'first_dense_layers', 2), 'at least one layer'),
    ('model.dense_d_ff', lambda c: (setattr(c.model, 'first_dense_layers', 1), setattr(c.model, 'dense_d_ff', 0)), 'first_dense_layers'),
    ('model.num_shared_experts', lambda c: setattr(c.model, 'num_shared_experts', -1), '>= 0'),
    ('model.shared_d_ff', lambda c: (setattr(c.model, 'num_shared_experts', 1), setattr(c.model, 'shared_d_ff', 0)), 'num_shared_experts'),
    ('model.aux_loss_coef', lambda c: setattr(c.model, 'aux_loss_coef', -1.0), '>= 0'),
    ('model.attention_type', lambda c: setattr(c.model, 'attention_type', 'linear'), 'dense'),
    ('model.qk_norm_init', lambda c: setattr(c.model, 'qk_norm_init', 0.0), '> 0'),
    ('model.dtype', lambda c: setattr(c.model, 'dtype', 'float16'), 'bfloat16'),
    ('model.first_sparse_layer', lambda c: (setattr(c.model, 'attention_type', 'msa'), setattr(c.model, 'first_sparse_layer', 5)), 'num_layers'),
    ('model.msa_block_size', lambda c: (setattr(c.model, 'attention_type', 'msa'), setattr(c.model, 'msa_block_size', 0)), '> 0'),
    ('model.msa_top_k', lambda c: (setattr(c.model, 'attention_type', 'msa'), setattr(c.model, 'msa_top_k', 0)), 'local block'),
    ('model.msa_index_dim', lambda c: (setattr(c.model, 'attention_type', 'msa'), setattr(c.model, 'msa_index_dim', 7)), 'even'),
    ('model.max_seq_len', lambda c: (setattr(c.model, 'attention_type', 'msa'), setattr(c.model, 'max_seq_len', 30)), 'multiple of msa_block_size'),
    ('model.msa_gpu_kernels', lambda c: setattr(c.model, 'msa_gpu_kernels', 'flash'), "'kv_outer', 'token' or 'tiles'"),
    ('parallel.num_data', lambda c: setattr(c.parallel, 'num_data', 0), '>= 1'),
    ('parallel.num_expert', lambda c: setattr(c.parallel, 'num_expert', 3), 'divisible by the EP size'),
    ('parallel.slots_per_device', lambda c: (setattr(c.parallel, 'num_expert', 4), setattr(c.parallel, 'slots_per_device', 1)), 'every expert needs a slot'),
    ('parallel.capacity_factors', lambda c: setattr(c.parallel, 'capacity_factors', (0.0,)), 'positive'),
    ('parallel.capacity_growth', lambda c: setattr(c.parallel, 'capacity_growth', 1.0), '> 1'),
    ('parallel.cell_growth', lambda c: setattr(c.parallel, 'cell_growth', 0.5), '> 1'),
    ('parallel.cell_factors', lambda c: setattr(c.parallel, 'cell_factors', (-1.0,)), 'positive'),
    ('parallel.dispatch', lambda c: setattr(c.parallel, 'dispatch', 'ragged'), 'must be one of'),
    ('transfer.step_rounds', lambda c: setattr(c.transfer, 'step_rounds', 0), '>= 1'),
    ('transfer.microstep_rounds', lambda c: setattr(c.transfer, 'microstep_rounds', 0), '>= 1'),
    ('transfer.flush', lambda c: setattr(c.transfer, 'flush', 'ring'), "'tree'"),
    ('planner.deadline_recompute_frac', lambda c: setattr(c.planner, 'deadline_recompute_frac', 0.0), '> 0'),
    ('rl.num_generations', lambda c: setattr(c.rl, 'num_generations', 1), 'group baseline'),
    ('rl.num_microbatches', lambda c: setattr(c.rl, 'num_microbatches', 0), '>= 1'),
    ('rl.num_microbatches', lambda c: setattr(c.rl, 'num_microbatches', 7), 'divisible by num_microbatches'),
    ('rl.eps_low', lambda c: setattr(c.rl, 'eps_low', 1.5), 'clip range'),
    ('rl.balance_step_tokens', lambda c: (setattr(c.rl, 'balance_step_tokens', True), setattr(c.rl, 'balance_microbatches', True)), 'turn one off'),
    ('rl.balance_step_tokens', lambda c: (setattr(c.rl, 'balance_step_tokens', True), setattr(c.model, 'aux_loss_coef', 0.01)), 'Switch balance loss'),
    ('rl.num_update_epochs', lambda c: setattr(c.rl, 'num_update_epochs', 0), '>= 1'),
    ('model.param_dtype', lambda c: setattr(c.model, 'param_dtype', 'float16'), 'bfloat16'),
    # Fields of the job around the model: each one is checked before any work.
    ('planner.method', lambda c: setattr(c.planner, 'method', 'bogus'), 'eplb_microstep'),
    ('planner.deadline_ms', lambda c: setattr(c.planner, 'deadline_ms', -1.0), '>= 0'),
    ('planner.num_nodes', lambda c: setattr(c.planner, 'num_nodes', 0), '>= 1'),
    # Each of these passed validation and failed after the warm start
    # (planner_setup), or at step 1 (3 nodes of an 8-device ring).
    ('planner.num_nodes', lambda c: setattr(c.planner, 'num_nodes', 3), 'must divide parallel.num_expert (8)'),
    ('planner.num_nodes', lambda c: setattr(c.planner, 'num_nodes', 16), 'must divide parallel.num_expert (8)'),
    ('planner.flops_per_s', lambda c: setattr(c.planner, 'flops_per_s', 0.0), '> 0'),
    ('planner.intra_node_bw', lambda c: setattr(c.planner, 'intra_node_bw', 0.0), '> 0'),
    ('planner.inter_node_bw', lambda c: setattr(c.planner, 'inter_node_bw', -1.0), '> 0'),
    ('planner.overlap', lambda c: setattr(c.planner, 'overlap', 1.5), '[0, 1]'),
    ('seed', lambda c: setattr(c, 'seed', -1), '>= 0'),
    # Batches split over the 8 devices by rows (a traceback deep in the
    # model before; the distillation's after the warm start).
    ('warmstart.batch_size', lambda c: setattr(c.warmstart, 'batch_size', 6), 'multiple of num_data * num_expert (8)'),
    ('msa_distill.batch_size', lambda c: (setattr(c.model, 'attention_type', 'msa'), c.msa_distill.update(steps=2, batch_size=3)), 'multiple of num_data * num_expert (8)'),
    ('msa_distill.eval_sequences', lambda c: (setattr(c.model, 'attention_type', 'msa'), c.msa_distill.update(steps=2, eval_sequences=5)), 'multiple of num_data * num_expert (8)'),
    ('rl.steps', lambda c: setattr(c.rl, 'steps', -1), '>= 0'),
    ('rl.prompts_per_step', lambda c: setattr(c.rl, 'prompts_per_step', 0), '>= 1'),
    ('rl.learning_rate', lambda c: setattr(c.rl, 'learning_rate', 0.0), '> 0'),
    ('rl.beta', lambda c: setattr(c.rl, 'beta', -0.1), 'KL'),
    ('rl.grad_clip', lambda c: setattr(c.rl, 'grad_clip', 0.0), '> 0'),
    ('rl.weight_decay', lambda c: setattr(c.rl, 'weight_decay', -1.0), '>= 0'),
    ('warmstart.steps', lambda c: setattr(c.warmstart, 'steps', -5), '>= 0'),
    ('warmstart.batch_size', lambda c: setattr(c.warmstart, 'batch_size', 0), '>= 1'),
    ('warmstart.learning_rate', lambda c: setattr(c.warmstart, 'learning_rate', -1.0), '> 0'),
    ('sampler.temperature', lambda c: setattr(c.sampler, 'temperature', 0.0), 'greedy'),
    ('sampler.top_k', lambda c: setattr(c.sampler, 'top_k', -1), '>= 0'),
    ('sampler.top_p', lambda c: setattr(c.sampler, 'top_p', 1.5), '(0, 1]'),
    ('checkpoint_every', lambda c: setattr(c, 'checkpoint_every', 0), '>= 1'),
    ('eval_prompts', lambda c: setattr(c, 'eval_prompts', -1), '>= 0'),
    ('task', lambda c: setattr(c, 'task', 'chess'), 'addition3_rev'),
    ('task_kwargs', lambda c: c.task_kwargs.update({'num_digitz': 3}), 'num_digitz'),
    ('model.vocab_size', lambda c: setattr(c.model, 'vocab_size', 8), 'vocabulary of task'),
    ('profile_steps', lambda c: setattr(c, 'profile_steps', '3,x'), 'RL step numbers'),
    ('profile_steps', lambda c: setattr(c, 'profile_steps', '0'), '>= 1'),
    ('model.remat_policy', lambda c: setattr(c.model, 'remat_policy', 'some'), 'minimal'),
    ('model.qk_norm_scope', lambda c: setattr(c.model, 'qk_norm_scope', 'all'), "'full'"),
    ('model.hf_model_type', lambda c: setattr(c.model, 'hf_model_type', 'llama'), 'qwen3_moe'),
    ('init_from_hf', lambda c: setattr(c, 'init_from_hf', '/nonexistent/hf'), 'config.json'),
    ('model.max_seq_len', lambda c: (setattr(c, 'task', 'sort5'), setattr(c.model, 'max_seq_len', 8)), 'prompt + completion'),
]


@pytest.mark.parametrize('field,mutate,rule', BAD, ids=[f'{b[0]}-{i}' for i, b in enumerate(BAD)])
def test_rule_rejects_with_clear_message(field, mutate, rule):
  c = tiny()
  mutate(c)
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate_config(c)
  msg = str(e.value)
  assert msg.startswith(field + ':'), msg
  assert rule in msg, msg


def test_capacity_buckets_factors_ascending_and_dropless_last():
  caps = config_lib.capacity_buckets(64, 2, 8, 4, dispatch='padded',
                                     factors=(1.0, 1.5, 2.0, 100.0))
  assert list(caps) == sorted(set(caps))
  assert caps[-1] == 128  # dropless: every local token's top-2 to one device
  assert caps[0] == 16  # a cell's uniform share: 64 * 2 / 8
  assert config_lib.pick_bucket(17, caps) == caps[1] == 24
  assert config_lib.pick_bucket(10_000, caps) == 128


def test_cell_buckets_double_from_the_uniform_pair_to_the_pair_bound():
  # 512 tokens x top-2 over 8 devices: 128 rows a pair if uniform; a token
  # sends one device at most min(top_k, s) = 2 rows, so no pair exceeds
  # 1,024 (the emulation's chunk without a bound).
  caps = config_lib.cell_buckets(512, 2, 8, 3)
  assert caps == (128, 256, 512, 1024)
  assert config_lib.pick_bucket(129, caps) == 256
  # parallel.cell_growth: a coarse ladder keeps the uniform pair and the
  # bound; 1.5x rounds each rung down to a multiple of 8.
  assert config_lib.cell_buckets(512, 2, 8, 3, growth=100) == (128, 1024)
  assert config_lib.cell_buckets(512, 2, 8, 3, growth=1.5) == (
      128, 192, 288, 432, 648, 968, 1024)
  # parallel.cell_factors: multiples of the uniform pair, the bound added.
  assert config_lib.cell_buckets(512, 2, 8, 3, factors=(100,)) == (1024,)
  assert config_lib.cell_buckets(512, 2, 8, 3, factors=(1.5, 3)) == (
      192, 384, 1024)


@pytest.mark.parametrize('dispatch,tokens,top_k,devices,spd,dropless', [
    # A token sends a device at most min(top_k, s) rows, one per slot.
    ('padded', 64, 2, 8, 4, 64 * 2),
    ('padded', 64, 8, 8, 3, 64 * 3),
    # A device receives at most that from each of the D sources.
    ('exact', 64, 2, 8, 4, 8 * 64 * 2),
    ('exact', 512, 8, 64, 3, 64 * 512 * 3),
])
def test_ladder_climbs_at_most_growth_to_the_one_dropless_bound(
    dispatch, tokens, top_k, devices, spd, dropless):
  assert config_lib.dropless_capacity(dispatch, tokens, top_k, devices,
                                      spd) == dropless
  caps = config_lib.capacity_buckets(tokens, top_k, devices, spd,
                                     dispatch=dispatch)
  assert caps[-1] == dropless and list(caps) == sorted(set(caps))
  assert all(c % 8 == 0 for c in caps[:-1])
  uniform = tokens * top_k / (devices if dispatch == 'padded' else 1)
  assert caps[0] == max(8, 8 * np.ceil(uniform / 8)) or caps[0] == dropless
  steps = np.asarray(caps[1:]) / np.asarray(caps[:-1])
  small = np.asarray(caps[1:]) - np.asarray(caps[:-1]) <= 8
  assert np.all((steps <= 1.25 + 1e-9) | small), caps
  # Every demand up to the bound gets a bucket at most 1.25x (or 8 rows)
  # larger than itself, never one that drops.
  for demand in range(1, dropless + 1, max(1, dropless // 997)):
    c = config_lib.pick_bucket(demand, caps)
    assert c >= demand
    assert c <= max(1.25 * demand, demand + 8, caps[0])


def test_fine_ladder_at_64_devices_is_short():
  """Qwen3-30B-A3B's shape at EP 64: 8,192 tokens, top-8, 18 slots a
  device: a receive bucket from the uniform 65,536 rows to the dropless
  64 x 8,192 x 8, in fewer than 25 rungs."""
  caps = config_lib.capacity_buckets(8192, 8, 64, 18, dispatch='exact')
  assert caps[0] == 8192 * 8 and caps[-1] == 64 * 8192 * 8
  assert len(caps) <= 25


def test_profile_steps_parse():
  c = tiny()
  assert config_lib.profile_steps(c) == ()
  c.profile_steps = ' 3, 5 '
  assert config_lib.profile_steps(c) == (3, 5)
