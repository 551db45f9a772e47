"""Small RL-step fixtures shared by the numerics tests: a one-layer MoE on a
(1, 2) mesh, a synthetic batch with prompt, completion and padding, and
placements whose replicas move between micro-steps (so slot gradients travel
home through the transfer engine).

Small on purpose: every test here compiles the update, and compile time
grows with layers and EP devices.
"""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from foremoe_jax import placement as placement_lib
from foremoe_jax.model import expert_parallel as ep
from foremoe_jax.model import sharding, transformer
from foremoe_jax.planner.topology import Topology
from foremoe_jax.rl import step as step_lib
from foremoe_jax.transfer import schedule

NUM_EXPERTS, NUM_EP, SLOTS_PER_DEVICE = 4, 2, 3
NUM_GEN, NUM_SAMPLES, SEQ_LEN, PROMPT_LEN = 4, 8, 12, 4
BUDGET = schedule.TransferBudget(step_rounds=4, microstep_rounds=4)
LOSS_KW = dict(num_generations=NUM_GEN, eps_low=0.2, eps_high=0.28, beta=0.0)


def mini_config(dtype: str = 'float32'):
  """configs/tiny.py cut to one MoE layer of 4 experts; dtype is both the
  compute and the param dtype (as in the real bf16 configs)."""
  cfg = importlib.import_module('configs.tiny').get_config()
  m = cfg.model
  m.num_layers, m.num_experts, m.top_k = 1, NUM_EXPERTS, 2
  m.dtype = m.param_dtype = dtype
  cfg.parallel.num_expert = NUM_EP
  cfg.parallel.slots_per_device = SLOTS_PER_DEVICE
  return cfg


def build(cfg, seed: int = 0):
  """(mesh, graphdef, params as the model stores them)."""
  mesh = ep.make_mesh(1, NUM_EP)
  model = transformer.Transformer(cfg.model, mesh, rngs=nnx.Rngs(seed))
  return (mesh, *sharding.split_model(model, mesh))


def graphdef_of(cfg, mesh):
  """The model's graphdef without computing any weight."""
  return nnx.split(nnx.eval_shape(lambda: transformer.Transformer(
      cfg.model, mesh, rngs=nnx.Rngs(0))))[0]


def synthetic_batch(num_microbatches: int, seed: int = 0) -> dict:
  """A rollout-shaped RL batch (rl/step.py's [M, b, ...] layout): prompts
  of PROMPT_LEN tokens, completions of random length (the rest padding),
  random top-2 routes, random rewards, random micro-batches."""
  rng = np.random.default_rng(seed)
  b, t = NUM_SAMPLES, SEQ_LEN
  tokens = rng.integers(1, 16, (b, t)).astype(np.int32)
  lengths = rng.integers(PROMPT_LEN + 2, t + 1, b)
  valid = np.arange(t)[None] < lengths[:, None]
  target_pos = np.arange(1, t)
  loss_mask = valid[:, 1:] & (target_pos >= PROMPT_LEN)[None]
  routes = np.argsort(rng.random((1, b, t - 1, NUM_EXPERTS)), -1)[..., :2]
  order = rng.permutation(b)
  mb = np.sort(order.reshape(num_microbatches, -1), axis=1).astype(np.int32)
  return jax.tree.map(jnp.asarray, dict(
      tokens_MbT=tokens[mb], valid_MbT=valid[mb],
      loss_mask_MbT=loss_mask.astype(np.float32)[mb],
      routes_MLbTK=np.moveaxis(routes.astype(np.int32)[:, mb], 1, 0),
      rewards_B=rng.random(b).astype(np.float32),
      microbatches_Mb=mb))


def per_sample(batch: dict, key: str) -> np.ndarray:
  """A batch array back in sample order: [B, ...] ([L, B, ...] for
  routes)."""
  mb = np.asarray(batch['microbatches_Mb']).ravel()
  x = np.asarray(batch[key])
  if key == 'routes_MLbTK':
    x = np.moveaxis(x, 1, 0)  # [L, M, b, ...]
    flat = x.reshape((x.shape[0], -1) + x.shape[3:])
    out = np.empty_like(flat)
    out[:, mb] = flat
    return out
  flat = x.reshape((-1,) + x.shape[2:])
  out = np.empty_like(flat)
  out[mb] = flat
  return out


def moving_plan(num_microbatches: int, seed: int = 0) -> step_lib.StepPlan:
  """Experts at home plus one replica per device that changes every
  micro-step; tokens split evenly over an expert's copies."""
  rng = np.random.default_rng(seed)
  spd = SLOTS_PER_DEVICE
  homes = NUM_EXPERTS // NUM_EP
  se, share = [], []
  for _ in range(num_microbatches):
    se_S = np.concatenate([
        np.r_[np.arange(d * homes, (d + 1) * homes),
              rng.integers(NUM_EXPERTS, size=spd - homes)]
        for d in range(NUM_EP)]).astype(np.int32)
    copies_S = (se_S[:, None] == se_S[None, :]).sum(1)
    se.append(se_S[None])
    share.append(np.broadcast_to(1.0 / copies_S, (1, NUM_EP, len(se_S))
                                 ).astype(np.float32))
  placement = placement_lib.Placement(np.stack(se), np.stack(share))
  return step_lib.make_step_plan(placement, NUM_EXPERTS,
                                 Topology(1, NUM_EP, spd), BUDGET)


def home_plan(num_microbatches: int) -> step_lib.StepPlan:
  """Every expert in its home slot every micro-step, nothing moving: static
  EP through the slots."""
  placement = placement_lib.stack_placements(
      [placement_lib.identity_placement(1, NUM_EXPERTS, NUM_EP,
                                        SLOTS_PER_DEVICE)] * num_microbatches)
  return step_lib.make_step_plan(placement, NUM_EXPERTS,
                                 Topology(1, NUM_EP, SLOTS_PER_DEVICE), BUDGET)


def grads_fn(**loss_kw):
  """jit(state, batch, plan) -> (grads, metrics): recompute (old
  log-probs, canonical layout) + update_grads."""
  kw = dict(LOSS_KW, **loss_kw)

  def fn(state, batch, plan):
    logps = step_lib.recompute_logps(state, batch, None, old=True, ref=False)
    return step_lib.update_grads(state, batch, logps, plan, **kw)
  return jax.jit(fn)


def tree_max_abs(tree) -> float:
  return max(float(jnp.abs(x).max()) for x in jax.tree.leaves(tree))
