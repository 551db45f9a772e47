"""OLMoE-1B-7B (16 layers, 64 experts, top-8, no top-k renormalisation):
GRPO on GSM8K on one node of 8 H100s.

Run on 1 node x 8 H100 (one process per GPU; WORKSPACE.md, "Running the
real-size configs"):
  srun --nodes=1 --ntasks-per-node=8 --gpus-per-task=1 \
    env FOREMOE_DISTRIBUTED=auto python -m experiments.rl_train \
    --config=configs/olmoe_1b_7b.py --workdir=/shared/run \
    --config.init_from_hf=/shared/OLMoE-1B-7B-0924-Instruct
Smoke test, one layer on 8 simulated CPU devices:
  python -m experiments.make_word_problems --out_dir=data/word_problems
  python -m experiments.rl_train --config=configs/olmoe_1b_7b.py:smoke \
    --workdir=/tmp/smoke_olmoe
Shapes only (no weights allocated):
  python -m experiments.model_shapes --config=configs/olmoe_1b_7b.py

Cluster: 1 node x 8 H100 = 8 devices, mesh 1 data x 8 expert. 6.9B
parameters: the 64 experts' float32 master and Adam moments over 8 GPUs
are 0.8B parameters (9.7 GB) a device, so one node holds the model and
every all-to-all stays on NVLink (planner.num_nodes = 1).

Smoke reductions (SMOKE_REDUCED below; configs/_real_rl.py lists the ones
every real config shares, layers and vocabulary among them):
  `model.num_experts` 64 -> 16: an expert is 6.3M parameters (d_model
      2,048, d_ff 1,024); 64 of them with Adam, gradients, the KL
      reference and 10 slots on each of 8 simulated devices would not fit
      in 8 GB. 16 keep top-8 routing a choice.
  `parallel.slots_per_device` 10 -> 4: 2 homes + 2 redundant, as on the
      cluster 8 homes + 2 redundant.
Head count, head_dim, d_model, the experts' d_ff and the mesh stay real.
"""
import ml_collections

from configs import _real_rl
from foremoe_jax import config as config_lib

SMOKE_REDUCED = {
    'model.num_experts': 16,
    'parallel.slots_per_device': 4,
}


def model_config() -> ml_collections.ConfigDict:
  """OLMoE-1B-7B's shape, as its Hugging Face config.json gives it."""
  m = config_lib.model_defaults()
  m.name = 'olmoe_1b_7b'
  m.hf_model_type = 'olmoe'  # Export writes this family.
  m.vocab_size = 50_304
  m.d_model = 2048
  m.num_layers = 16
  m.num_heads = 16
  m.num_kv_heads = 16  # No GQA.
  m.head_dim = 128
  m.rope_theta = 10_000.0
  m.qk_norm = True
  m.qk_norm_scope = 'full'  # One RMSNorm over all heads' q (and k).
  m.tie_embeddings = False
  m.norm_eps = 1e-5  # rms_norm_eps (the framework's default is 1e-6).
  m.max_seq_len = 4096  # max_position_embeddings; only a bound here.
  m.num_experts = 64
  m.top_k = 8
  m.moe_d_ff = 1024
  m.renormalize_topk = False  # OLMoE keeps the top-8 softmax weights.
  # bfloat16 compute and slot copies; the train state is a float32 master
  # (WORKSPACE.md, "Mixed precision").
  m.dtype = 'bfloat16'
  m.param_dtype = 'bfloat16'
  # Recompute each block in the backward pass: 4 sequences of 1,280 tokens
  # per device per micro-step at d_model 2,048 keep ~1 GB of activations a
  # layer otherwise.
  m.remat_policy = 'full'
  # MSA's shape, for tools that try it (attention stays dense: a Hugging
  # Face checkpoint has no MSA index weights).
  m.msa_block_size = 128
  m.msa_top_k = 16
  m.msa_index_dim = 128
  return m


def get_config(variant: str = '') -> ml_collections.ConfigDict:
  c = _real_rl.full_config(
      model_config(), num_data=1, num_expert=8,
      slots_per_device=10,  # 8 homes + 2 redundant per device.
      num_nodes=1,
      # 64 x 8 = 512 sequences in 16 micro-steps: 4 per device per
      # micro-step.
      prompts_per_step=64, num_microbatches=16)
  return _real_rl.variant(c, variant, SMOKE_REDUCED)
