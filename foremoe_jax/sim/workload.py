"""What the simulated cluster runs: model shapes, the EP group, the batch.

`ModelShape` is read from a model config (the same configs that train), so
the simulator's shapes are the repository's shapes; FLOPs per token are
counted here from those shapes. `Workload` adds how an RL step is cut into
micro-steps on a cluster: every device holds one micro-batch per micro-step
(data parallel for attention), the expert-parallel group is
`min(devices, experts)` devices, and larger clusters hold several EP groups
side by side (data parallel over groups).

Shape letters: M micro-steps, L MoE layers, D EP devices, E experts.
"""
from __future__ import annotations

import dataclasses
import importlib

import ml_dtypes
import numpy as np

from foremoe_jax.foresight import traces

MODELS = {
    'qwen3_30b_a3b': 'configs.qwen3_30b_a3b',
    'deepseek_v3_like': 'configs.deepseek_v3_like',
    'mixtral_8x7b': 'configs.mixtral_8x7b',
}

# Step-level share of a layer's hottest expert, the knob the synthetic trace
# is calibrated on. Qwen3-30B-A3B: 4-6% at E = 128 (5-8x uniform, public
# routing statistics). DeepSeek-V3-like at E = 256: the same multiple of
# uniform. Mixtral 8x7B: its paper finds no strong expert specialisation,
# so the hottest of 8 experts takes 15-19% (1.2-1.5x uniform).
HOT_SHARE = {
    'qwen3_30b_a3b': (0.04, 0.06),
    'deepseek_v3_like': (0.02, 0.03),
    'mixtral_8x7b': (0.15, 0.19),
}


@dataclasses.dataclass(frozen=True)
class ModelShape:
  """The numbers the simulator needs from a model config."""

  name: str
  d_model: int
  moe_d_ff: int
  num_experts: int
  top_k: int
  num_layers: int
  num_moe_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  vocab_size: int
  shared_d_ff: int  # Total width of shared experts (0: none).
  dense_d_ff: int  # FFN width of the leading dense layers.
  bytes_per_param: int  # Storage dtype of expert weights (moves, reads).

  @classmethod
  def from_config(cls, model_cfg) -> 'ModelShape':
    m = model_cfg
    return cls(
        name=m.name, d_model=m.d_model, moe_d_ff=m.moe_d_ff,
        num_experts=m.num_experts, top_k=m.top_k, num_layers=m.num_layers,
        num_moe_layers=m.num_layers - m.first_dense_layers,
        num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim, vocab_size=m.vocab_size,
        shared_d_ff=m.shared_d_ff * m.num_shared_experts,
        dense_d_ff=m.dense_d_ff if m.first_dense_layers else 0,
        bytes_per_param=int(np.dtype(ml_dtypes.bfloat16 if m.param_dtype ==
                                     'bfloat16' else m.param_dtype).itemsize))

  @property
  def params_per_expert(self) -> int:
    return 3 * self.d_model * self.moe_d_ff  # SwiGLU: gate, up, down.

  @property
  def bytes_per_expert(self) -> int:
    return self.params_per_expert * self.bytes_per_param

  def expert_flops_per_row(self, passes: int = 3) -> float:
    """FLOPs of one token-assignment in one expert: 2 per parameter
    forward, 4 more backward (passes=3), 2 for forward only (passes=1)."""
    return 2.0 * passes * self.params_per_expert

  def attention_params(self) -> int:
    d, hd = self.d_model, self.head_dim
    return d * hd * (2 * self.num_heads + 2 * self.num_kv_heads)

  def nonexpert_flops_per_token(self, seq_len: int, passes: int = 3) -> float:
    """FLOPs per token of everything but the routed experts, all layers:
    attention projections, causal scores (mean context seq_len / 2), router,
    shared experts, dense FFN layers and the output head."""
    per_layer = (2.0 * self.attention_params()
                 + 2.0 * 2.0 * (seq_len / 2.0) * self.num_heads * self.head_dim)
    moe = self.num_moe_layers * (2.0 * self.d_model * self.num_experts
                                 + 6.0 * self.d_model * self.shared_d_ff)
    dense = (self.num_layers - self.num_moe_layers) * 6.0 * (
        self.d_model * self.dense_d_ff)
    head = 2.0 * self.d_model * self.vocab_size
    return passes * (self.num_layers * per_layer + moe + dense + head)

  def nonexpert_params(self) -> int:
    """Parameters outside the routed experts (replicated over EP)."""
    d = self.d_model
    per_layer = self.attention_params() + 2 * d
    moe = self.num_moe_layers * (d * self.num_experts + 3 * d * self.shared_d_ff)
    dense = (self.num_layers - self.num_moe_layers) * 3 * d * self.dense_d_ff
    return (self.num_layers * per_layer + moe + dense
            + 2 * self.vocab_size * d)


def load_model_config(name: str):
  """The whole experiment config the model's shape comes from."""
  if name not in MODELS:
    raise ValueError(f'unknown model {name!r}; pick from {sorted(MODELS)}.')
  return importlib.import_module(MODELS[name]).get_config()


def load_model_shape(name: str) -> ModelShape:
  return ModelShape.from_config(load_model_config(name).model)


@dataclasses.dataclass(frozen=True)
class Workload:
  """One RL step's update phase on a cluster."""

  num_devices: int
  num_microsteps: int = 8
  seqs_per_microbatch: int = 2  # Per device and micro-step.
  tokens_per_seq: int = 4096
  redundant_slots_per_device: int = 2
  # Forwards the recompute runs (rl/step.py `RLStep.recompute_passes`): the
  # default config's, one update epoch with a KL term: the reference
  # policy's only.
  recompute_forward_passes: int = 1
  # The update's activation policy (model.remat_policy); the real configs
  # run 'full'.
  remat_policy: str = 'full'
  # Non-expert master weights and Adam moments split over every device
  # (parallel.fsdp = True, fsdp_axes = 'data+expert'): gathered once per
  # step, updated per shard. False: replicated (parallel.fsdp = False).
  fsdp_all: bool = True
  # Each micro-step's sequences laid out over the devices to even their
  # token counts (rl.balance_device_tokens), or in draw order.
  balance_device_tokens: bool = True
  # Each step's micro-steps chosen for even device token counts too
  # (rl.balance_step_tokens).
  balance_step_tokens: bool = True

  def ep_size(self, model: ModelShape) -> int:
    """EP group: every device while experts go round, at most E devices."""
    ep = min(self.num_devices, model.num_experts)
    if model.num_experts % ep or self.num_devices % ep:
      raise ValueError(f'{model.name}: E = {model.num_experts} experts do not '
                       f'split over {self.num_devices} devices.')
    return ep

  def slots_per_device(self, model: ModelShape) -> int:
    return (model.num_experts // self.ep_size(model)
            + self.redundant_slots_per_device)

  @property
  def tokens_per_device(self) -> int:
    """Tokens of one device's micro-batch (one micro-step)."""
    return self.seqs_per_microbatch * self.tokens_per_seq


def synthetic_loads(model: ModelShape, work: Workload, num_steps: int = 2,
                    seed: int = 0, hot_share=None) -> traces.Trace:
  """A calibrated synthetic trace for one EP group: [R, M, L, D, E].

  The simulator plans and times one EP group; groups beside it (data
  parallel) see the same statistics.
  """
  return traces.synthetic_trace(traces.SyntheticTraceConfig(
      num_steps=num_steps, num_microsteps=work.num_microsteps,
      num_layers=model.num_moe_layers, num_experts=model.num_experts,
      top_k=model.top_k, num_devices=work.ep_size(model),
      seqs_per_microbatch=work.seqs_per_microbatch,
      tokens_per_seq=work.tokens_per_seq,
      hot_share_range=tuple(hot_share or HOT_SHARE.get(model.name,
                                                        (0.04, 0.06))),
      balance_device_tokens=work.balance_device_tokens,
      balance_step_tokens=work.balance_step_tokens, seed=seed))
