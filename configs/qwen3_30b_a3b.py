"""Qwen3-30B-A3B (48 layers, 128 experts, top-8): GRPO on GSM8K on 64 H100s.

Run on 8 nodes x 8 H100 (one process per GPU; WORKSPACE.md, "Running the
real-size configs"):
  srun --nodes=8 --ntasks-per-node=8 --gpus-per-task=1 \
    env FOREMOE_DISTRIBUTED=auto python -m experiments.rl_train \
    --config=configs/qwen3_30b_a3b.py --workdir=/shared/run \
    --config.init_from_hf=/shared/Qwen3-30B-A3B
Smoke test, one layer on 8 simulated CPU devices (3 min, 6.6 GB peak RSS
on a shared 2-core host; WORKSPACE.md has every config's):
  python -m experiments.make_word_problems --out_dir=data/word_problems
  python -m experiments.rl_train --config=configs/qwen3_30b_a3b.py:smoke \
    --workdir=/tmp/smoke_q3
Shapes only (no weights allocated; also the cluster simulator's input):
  python -m experiments.model_shapes --config=configs/qwen3_30b_a3b.py

Cluster: 8 nodes x 8 H100 = 64 devices, mesh 1 data x 64 expert. With
EP 64 each GPU holds 2 of the 128 experts' homes (+2 redundant slots), so
the expert master and Adam moments take 5.4 GB a device instead of 43 GB at
EP 8 (results/simulate_cluster.json); the update's peak is 64.2 GB of an
80 GB H100 (XLA's compiled step at full depth, the moves in the layers,
results/memory_report.json
from experiments.memory_report; remat 'full', fsdp over every device),
which EP 8 x data 8 would not meet. The all-to-all then crosses nodes,
which the planner's two tiers (planner.num_nodes = 8) price.

Smoke reductions (SMOKE_REDUCED below; configs/_real_rl.py lists the ones
every real config shares, layers and vocabulary among them):
  `model.num_experts` 128 -> 16: at d_model 2,048 and expert d_ff 768 an
      expert is 4.7M parameters; 128 of them in float32 with both Adam
      moments, the gradient and the KL reference would be 12 GB on their own.
      16 keep top-8 routing and 2 homes per device, as on the cluster.
  `parallel.num_expert` 64 -> 8: the 8 simulated devices (2 homes + 2
      redundant slots per device, as on the cluster).
  `planner.num_nodes` 8 -> 2: the 8 devices as 2 nodes of 4, so the
      planner's two tiers still act.
  `transfer.step_rounds` 64 -> 8: one round per device of the ring.
  `task_kwargs.chat_template_kwargs` -> '': the word-problem tokenizer has
      no chat template to pass it to.
Head count, head_dim, d_model and the experts' d_ff stay real.
"""
import ml_collections

from configs import _real_rl
from foremoe_jax import config as config_lib

SMOKE_REDUCED = {
    'model.num_experts': 16,
    'parallel.num_expert': 8,
    'planner.num_nodes': 2,
    'transfer.step_rounds': 8,
    'task_kwargs.chat_template_kwargs': '',
}


def model_config() -> ml_collections.ConfigDict:
  """Qwen3-30B-A3B's shape, as its Hugging Face config.json gives it."""
  m = config_lib.model_defaults()
  m.name = 'qwen3_30b_a3b'
  m.hf_model_type = 'qwen3_moe'  # Export writes this family.
  m.vocab_size = 151_936
  m.d_model = 2048
  m.num_layers = 48
  m.num_heads = 32
  m.num_kv_heads = 4  # GQA, 8 query heads per KV head.
  m.head_dim = 128  # Not d_model / heads (64): Qwen3 sets it apart.
  m.rope_theta = 1_000_000.0
  m.qk_norm = True  # RMSNorm of q and k per head.
  m.tie_embeddings = False
  m.max_seq_len = 40_960  # max_position_embeddings; only a bound here.
  m.num_experts = 128
  m.top_k = 8
  m.moe_d_ff = 768
  m.renormalize_topk = True  # norm_topk_prob.
  # bfloat16 compute and slot copies; the train state is a float32 master
  # (WORKSPACE.md, "Mixed precision").
  m.dtype = 'bfloat16'
  m.param_dtype = 'bfloat16'
  # Recompute each block in the backward pass: the memory report's peak
  # per device (results/memory_report.json) assumes it.
  m.remat_policy = 'full'
  # MSA's shape, for tools that try it (attention stays dense: a Hugging
  # Face checkpoint has no MSA index weights).
  m.msa_block_size = 128
  m.msa_top_k = 16
  m.msa_index_dim = 128
  return m


def get_config(variant: str = '') -> ml_collections.ConfigDict:
  c = _real_rl.full_config(
      model_config(), num_data=1, num_expert=64,
      slots_per_device=4,  # 2 homes + 2 redundant per device.
      num_nodes=8,
      # 128 x 8 = 1,024 sequences in 8 micro-steps: 2 per device per
      # micro-step, the simulator's and memory report's workload.
      prompts_per_step=128, num_microbatches=8,
      # Qwen3 is a hybrid thinking model: answer directly, as the
      # 1,024-token completion budget assumes.
      chat_template_kwargs='{"enable_thinking": false}')
  return _real_rl.variant(c, variant, SMOKE_REDUCED)
