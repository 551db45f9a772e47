"""Mixtral-8x7B (32 layers, 8 experts, top-2): GRPO on GSM8K laid out on
64 H100s, and its smoke test. The full run does NOT fit yet: see below.

Run on 8 nodes x 8 H100 (one process per GPU; WORKSPACE.md, "Running the
real-size configs"):
  srun --nodes=8 --ntasks-per-node=8 --gpus-per-task=1 \
    env FOREMOE_DISTRIBUTED=auto python -m experiments.rl_train \
    --config=configs/mixtral_8x7b.py --workdir=/shared/run \
    --config.init_from_hf=/shared/Mixtral-8x7B-Instruct-v0.1
Smoke test, one layer on 8 simulated CPU devices:
  python -m experiments.make_word_problems --out_dir=data/word_problems
  python -m experiments.rl_train --config=configs/mixtral_8x7b.py:smoke \
    --workdir=/tmp/smoke_mixtral
Shapes only (no weights allocated; also the cluster simulator's input):
  python -m experiments.model_shapes --config=configs/mixtral_8x7b.py

Cluster: 8 nodes x 8 H100 = 64 devices, mesh 8 data x 8 expert. With 8
experts the EP ring is at most 8 devices: one per node, so every
all-to-all stays on NVLink (planner.num_nodes = 1) and the 8 nodes are data
parallel. Memory: experts are sharded over 'expert' only, so each GPU
holds a whole expert per layer (32 x 176M parameters) in float32 with Adam
moments, slots and their gradients: 254 GB a device by the simulator's
memory model (results/simulate_cluster.json), over an 80 GB H100 at any
device count. It runs once experts are also sharded over 'data'
(WORKSPACE.md, "Known not to scale yet").

Smoke reductions (SMOKE_REDUCED below; configs/_real_rl.py lists the ones
every real config shares, layers and vocabulary among them):
  `model.moe_d_ff` 14,336 -> 512: one expert at the real width is 176M
      parameters, and each of the 8 simulated devices holds 2 slots of one
      besides the 8 canonical experts with Adam, gradients and the KL
      reference: over 30 GB. The expert count and top-2 routing stay real,
      the width goes.
  `parallel.num_data` 8 -> 1: the 8 simulated devices are one EP ring.
Head count, head_dim, d_model, the experts and the EP ring stay real.
"""
import ml_collections

from configs import _real_rl
from foremoe_jax import config as config_lib

SMOKE_REDUCED = {
    'model.moe_d_ff': 512,
    'parallel.num_data': 1,
}


def model_config() -> ml_collections.ConfigDict:
  """Mixtral-8x7B's shape, as its Hugging Face config.json gives it."""
  m = config_lib.model_defaults()
  m.name = 'mixtral_8x7b'
  m.hf_model_type = 'mixtral'  # Export writes this family.
  m.vocab_size = 32_000
  m.d_model = 4096
  m.num_layers = 32
  m.num_heads = 32
  m.num_kv_heads = 8  # GQA, 4 query heads per KV head.
  m.head_dim = 128
  m.rope_theta = 1_000_000.0
  m.tie_embeddings = False
  m.norm_eps = 1e-5  # rms_norm_eps (the framework's default is 1e-6).
  m.max_seq_len = 32_768  # max_position_embeddings; only a bound here.
  m.num_experts = 8
  m.top_k = 2
  m.moe_d_ff = 14_336
  m.renormalize_topk = True  # Softmax over the top-2 logits.
  # bfloat16 compute and slot copies; the train state is a float32 master
  # (WORKSPACE.md, "Mixed precision").
  m.dtype = 'bfloat16'
  m.param_dtype = 'bfloat16'
  m.remat_policy = 'full'  # Each block recomputed in the backward pass.
  # MSA's shape, for tools that try it (attention stays dense: a Hugging
  # Face checkpoint has no MSA index weights).
  m.msa_block_size = 128
  m.msa_top_k = 16
  m.msa_index_dim = 128
  return m


def get_config(variant: str = '') -> ml_collections.ConfigDict:
  c = _real_rl.full_config(
      model_config(), num_data=8, num_expert=8,
      slots_per_device=2,  # 1 home + 1 redundant per device.
      num_nodes=1,
      # 128 x 8 = 1,024 sequences in 8 micro-steps: 2 per device per
      # micro-step, the simulator's workload.
      prompts_per_step=128, num_microbatches=8)
  return _real_rl.variant(c, variant, SMOKE_REDUCED)
