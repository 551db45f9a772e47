"""Load traces recorded from the repository's own sampler (not synthetic).

Sits beside ``traces.synthetic_trace``: the planner benchmark scores
planners on both. Each RL step here runs the same phases as the trainer's
(``rl/trainer.py``), on a model with a realistic expert count:

  rollout   ``rollout.sampler.Sampler`` on the task's prompts (temperature
            1, ``num_generations`` samples per prompt: GRPO groups),
  compose   ``composition.compose_microbatches`` over the routes without
            the last position (``rl.balance_microbatches`` off, seed
            ``seed + step``, as the tiny config),
  foresight ``loads.microstep_loads(routes[:, :, :-1], valid[:, :-1], ...)``
            for ``d_data`` x ``d_ep`` devices,

and the per-step loads [M, L, D, E] are stacked with
``traces.trace_from_step_loads``.

What the trace is, honestly: the model is a *random initialisation* (no
warm start, no RL), a few layers of small width, sampling on the
'addition' task. It is not a trained model's routing. It is nevertheless
skewed, not near-uniform: the task's vocabulary has 15 ids (12 symbols and
3 specials), and at random init a token's hidden state is dominated by its
own embedding, so routing is close to a function of the token and the few
digit tokens pile onto a few experts per layer. In the committed traces the
hottest expert takes 7.5-12% of a layer's selections at E=64 top-2 and
7-10% at E=128 top-8 (uniform: 1.6% and 0.8%; Qwen3-30B-A3B's public
figure is 4-6% at E=128), and 0-13 experts of a layer get nothing. Because routing follows tokens rather than sequences, micro-steps
of one step look alike (little per-micro-step swing): it complements the
synthetic traces, whose per-sequence correlation makes micro-steps differ.
Scaling the embeddings (0.2x) or the router does not change this (top-k ids
are scale-invariant, and RMSNorm precedes the router).

Regenerate the committed traces (results/traces/sampler_*.npz) with:

  python -m experiments.bench_planner --regenerate_traces --json

(about 2 minutes on 2 CPU cores; jax on 8 simulated CPU devices). Importing
this module does not import jax (``generate_trace`` does), so loading a
cached trace keeps the planner benchmark jax-free.

Shape letters: R RL steps, M micro-steps, L layers, D devices, E experts,
B samples, T tokens, K top-k.
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from foremoe_jax.foresight import composition, traces
from foremoe_jax.foresight import loads as loads_lib


@dataclasses.dataclass(frozen=True)
class SampledTraceConfig:
  """Model, task and RL-batch shape of one recorded trace."""

  name: str
  """Trace label; the benchmark calls the trace 'sampler:<name>'."""
  num_experts: int
  top_k: int
  num_layers: int = 4
  """MoE layers (every layer is MoE)."""
  d_model: int = 64
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  moe_d_ff: int = 32
  task: str = 'addition'
  prompts_per_step: int = 256
  num_generations: int = 8
  num_microsteps: int = 8
  num_steps: int = 4
  """RL steps (R); the benchmark scores all but the first."""
  d_ep: int = 8
  d_data: int = 1
  temperature: float = 1.0
  seed: int = 0

  @property
  def source(self) -> str:
    return f'sampler:{self.name}'

  def model_config(self, vocab_size: int, max_seq_len: int):
    """The model's ml_collections config (dense attention, no shared experts)."""
    from foremoe_jax import config as config_lib  # ml_collections only.
    m = config_lib.model_defaults()
    m.name = f'sampled_{self.name}'
    m.vocab_size = vocab_size
    m.d_model, m.num_layers = self.d_model, self.num_layers
    m.num_heads, m.num_kv_heads = self.num_heads, self.num_kv_heads
    m.head_dim, m.moe_d_ff = self.head_dim, self.moe_d_ff
    m.num_experts, m.top_k = self.num_experts, self.top_k
    m.max_seq_len = max_seq_len
    return m


def default_sampled_configs() -> list[SampledTraceConfig]:
  """E=64 top-2 (OLMoE/Mixtral-like counts) and E=128 top-8 (Qwen3-like).

  E=64 gets twice the prompts (sampling it is cheap) so both have a few
  hundred tokens per device and micro-step.
  """
  return [SampledTraceConfig('E64_top2', 64, 2, prompts_per_step=512),
          SampledTraceConfig('E128_top8', 128, 8, prompts_per_step=256)]


def generate_trace(cfg: SampledTraceConfig, keep_rollouts: bool = False):
  """Runs rollout -> compose -> foresight for cfg.num_steps RL steps.

  Needs cfg.d_data * cfg.d_ep jax devices (on CPU, set XLA_FLAGS
  --xla_force_host_platform_device_count before jax is imported). The meta
  records the config, the valid tokens per (step, micro-step) and the
  hottest expert's share. Returns the Trace, or (Trace, the rollouts) with
  keep_rollouts (for checking against the trainer's phases).
  """
  # jax only here: loading a cached trace must not pay for it.
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from foremoe_jax.model import expert_parallel, sharding, transformer  # pylint: disable=g-import-not-at-top
  from foremoe_jax.rollout import sampler as sampler_lib  # pylint: disable=g-import-not-at-top
  from foremoe_jax.tasks import get_task  # pylint: disable=g-import-not-at-top

  task = get_task(cfg.task)
  model_cfg = cfg.model_config(task.vocab_size, task.sequence_len)
  mesh = expert_parallel.make_mesh(cfg.d_data, cfg.d_ep)
  model = transformer.Transformer(model_cfg, mesh, rngs=nnx.Rngs(cfg.seed))
  graphdef, params = sharding.split_model(model, mesh)
  sampler = sampler_lib.Sampler(graphdef, model_cfg, mesh,
                                sampler_lib.SamplingParams(
                                    max_new_tokens=task.completion_len,
                                    num_generations=cfg.num_generations,
                                    temperature=cfg.temperature))
  rng = np.random.default_rng(cfg.seed)
  key = jax.random.key(cfg.seed)
  step_loads, tokens_RM, rollouts = [], [], []
  for step in range(cfg.num_steps):
    key, k_sample = jax.random.split(key)
    prompts_NP = task.sample_prompts(rng, cfg.prompts_per_step)
    ro = sampler(params, prompts_NP, k_sample)
    if keep_rollouts:
      rollouts.append(ro)
    # RL feeds tokens[:, :-1] and replays routes[:, :, :-1] (sampler doc).
    routes_LBTK, valid_BT = ro.routes_LBTK[:, :, :-1], ro.valid_BT[:, :-1]
    microbatches = composition.compose_microbatches(
        ro.tokens_BT.shape[0], cfg.num_microsteps, routes=routes_LBTK,
        valid=valid_BT, num_experts=cfg.num_experts, balance=False,
        seed=cfg.seed + step)
    step_loads.append(loads_lib.microstep_loads(
        routes_LBTK, valid_BT, microbatches, cfg.num_experts, cfg.d_data,
        cfg.d_ep))
    tokens_RM.append([int(valid_BT[idx].sum()) for idx in microbatches])
  hot_L = np.mean([traces.hottest_expert_share(x) for x in step_loads], 0)
  trace = traces.trace_from_step_loads(step_loads, {
      'source': cfg.source, 'init': 'random (no training)',
      **dataclasses.asdict(cfg), 'tokens_RM': tokens_RM,
      'hottest_expert_share_L': hot_L.round(4).tolist()})
  return (trace, rollouts) if keep_rollouts else trace


def trace_path(cfg: SampledTraceConfig, trace_dir: str) -> str:
  return os.path.join(trace_dir, f'sampler_{cfg.name}.npz')


def _matches(trace: traces.Trace, cfg: SampledTraceConfig) -> bool:
  # Compared as they read back from disk (JSON: tuples become lists).
  want = json.loads(json.dumps(dataclasses.asdict(cfg)))
  return all(trace.meta.get(k) == v for k, v in want.items())


def load_or_generate(cfg: SampledTraceConfig, trace_dir: str,
                     regenerate: bool = False) -> tuple[traces.Trace, bool]:
  """The cached trace at trace_path(cfg, trace_dir) if it was made from this
  very config, else a new one (saved there). Returns (trace, generated)."""
  path = trace_path(cfg, trace_dir)
  if not regenerate and os.path.exists(path):
    trace = traces.load_trace(path)
    if _matches(trace, cfg):
      return trace, False
  trace = generate_trace(cfg)
  os.makedirs(trace_dir, exist_ok=True)
  traces.save_trace(path, trace)
  return trace, True
