"""The main job's imperative shell: warm start, then GRPO with routing foresight.

Per RL step (DESIGN.md §2): sample (recording routes) -> rewards -> compose
micro-batches -> foresight loads [M, L, D, E] -> plan one placement per
micro-step (host, with a deadline and fallback) -> capacity bucket ->
`rl_step` (pure, jitted) -> metrics line, plots and checkpoints.
Everything on device lives in rl/step.py and rollout/sampler.py; this module
only moves arrays between them and the host-side planner.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from foremoe_jax import config as config_lib
from foremoe_jax import placement as placement_lib
from foremoe_jax import planner as planner_lib
from foremoe_jax.foresight import composition, loads as loads_lib
from foremoe_jax.model import expert_parallel, sharding, transformer
from foremoe_jax.rl import checkpoint, step as step_lib
from foremoe_jax.rollout import sampler as sampler_lib
from foremoe_jax.tasks import get_task
from foremoe_jax.utils import metrics as metrics_lib


def rl_batch_from_rollout(rollout, rewards_B, microbatches) -> dict:
  """Aligns the rollout with rl_step's T-1 input/target positions."""
  plen = rollout.prompt_len
  num, total = rollout.tokens_BT.shape
  # Target position t predicts token t + 1: a completion token when t+1 >= P.
  target_pos = np.arange(1, total)
  loss_mask = rollout.valid_BT[:, 1:] & (target_pos >= plen)[None]
  rollout_logp = np.zeros((num, total - 1), np.float32)
  rollout_logp[:, plen - 1:] = rollout.logp_BC
  return dict(
      tokens_BT=rollout.tokens_BT.astype(np.int32),
      valid_BT=rollout.valid_BT,
      loss_mask_BT=loss_mask.astype(np.float32),
      routes_LBTK=rollout.routes_LBTK[:, :, :-1],
      rewards_B=np.asarray(rewards_B, np.float32),
      microbatches_Mb=np.stack(microbatches).astype(np.int32),
      rollout_logp_BT=rollout_logp)


def planner_setup(config):
  """(Topology, CostModel) of the EP group the config describes."""
  m, p = config.model, config.planner
  cost = planner_lib.CostModel.from_expert_shape(
      m.d_model, m.moe_d_ff, bytes_per_param=jnp.dtype(m.param_dtype).itemsize,
      flops_per_s=p.get('flops_per_s', 4e14),
      intra_node_bw=p.get('intra_node_bw', 3.5e11),
      inter_node_bw=p.get('inter_node_bw', 5e10),
      overlap=p.get('overlap', 0.5))
  num_nodes = p.get('num_nodes', 1)
  topo = planner_lib.Topology(num_nodes, config.parallel.num_expert // num_nodes,
                              config_lib.slots_per_device(config))
  return topo, cost


def _log_line(step, m):
  mom = np.mean(m['microstep_max_over_mean'])
  mom_s = np.mean(m['microstep_max_over_mean_static'])
  return (f"step {step:4d} | reward {m['reward_mean']:.3f} | kl {m['kl']:.4f} "
          f"| micro-step max/mean {mom:.3f} (static {mom_s:.3f}) | capacity "
          f"{m['capacity']} (static {m['capacity_static']}) | "
          f"{m['step_s']:.2f}s")


def train(config, workdir: str) -> dict:
  """Runs warm start + RL in `workdir`; returns the summary.

  Writes warmstart.jsonl (SFT loss), metrics.jsonl (one line per RL step),
  summary.json, PNG plots and orbax checkpoints; a rerun with the same
  workdir resumes from the latest checkpoint.
  """
  config_lib.validate_config(config)
  os.makedirs(workdir, exist_ok=True)
  task = get_task(config.task, **config.get('task_kwargs', {}))
  mcfg = config.model
  if mcfg.vocab_size < task.vocab_size:
    raise config_lib.ConfigError(
        f'model.vocab_size: must be >= the task vocabulary ({task.vocab_size})')
  if mcfg.max_seq_len < task.sequence_len:
    raise config_lib.ConfigError(
        f'model.max_seq_len: must be >= prompt + completion '
        f'({task.sequence_len}) for task {config.task!r}')
  mesh = expert_parallel.make_mesh(config.parallel.num_data,
                                   config.parallel.num_expert)
  d_ep, d_data = config.parallel.num_expert, config.parallel.num_data
  spd = config_lib.slots_per_device(config)
  num_experts, num_moe = mcfg.num_experts, config_lib.num_moe_layers(mcfg)
  rng = np.random.default_rng(config.seed)
  key = jax.random.key(config.seed)

  model = transformer.Transformer(mcfg, mesh, rngs=nnx.Rngs(config.seed))
  graphdef, params = sharding.split_model(model, mesh)
  writer = metrics_lib.MetricsWriter(workdir)
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, 'checkpoints'))
  summary = {}

  # Phase 1: supervised warm start (skipped when a checkpoint has it).
  restored = ckpt.restore_latest(params)
  if restored is not None and restored['phase'] in ('warmstart_done', 'rl'):
    params = restored['params']
    print(f"restored the {restored['phase']} checkpoint at step "
          f"{restored['step']}", flush=True)
  else:
    tx = step_lib.make_optimizer(config.warmstart.learning_rate, 1.0)
    state = step_lib.init_train_state(graphdef, params, tx, mesh,
                                      with_ref=False)
    sft_step = step_lib.make_sft_step(tx, mcfg.msa_indexer_loss_coef,
                                      mcfg.aux_loss_coef)
    warm_writer = metrics_lib.MetricsWriter(workdir, 'warmstart.jsonl')
    t0 = time.perf_counter()
    for i in range(config.warmstart.steps):
      tokens, mask = task.supervised_batch(rng, config.warmstart.batch_size)
      state, m = sft_step(state, jnp.asarray(tokens), jnp.asarray(mask))
      if (i + 1) % 50 == 0 or i + 1 == config.warmstart.steps:
        m = jax.device_get(m)
        warm_writer.write(i + 1, dict(phase='warmstart', sft_loss=m['loss'],
                                 elapsed_s=time.perf_counter() - t0))
        print(f"warm start {i + 1:4d}/{config.warmstart.steps} | loss "
              f"{m['loss']:.4f} | {time.perf_counter() - t0:.1f}s", flush=True)
    warm_writer.close()
    params = state.params
    ckpt.save(0, params, phase='warmstart_done')

  # Phase 2: GRPO with routing foresight.
  rl = config.rl
  num_gen, num_mb = rl.num_generations, rl.num_microbatches
  sp = sampler_lib.SamplingParams(
      max_new_tokens=task.completion_len, num_generations=num_gen,
      temperature=config.sampler.temperature, top_k=config.sampler.top_k,
      top_p=config.sampler.top_p)
  sampler = sampler_lib.Sampler(graphdef, mcfg, mesh, sp)
  greedy = sampler_lib.Sampler(graphdef, mcfg, mesh, dataclasses.replace(
      sp, num_generations=1, greedy=True))
  num_eval = config.get('eval_prompts', 256)
  eval_prompts = task.sample_prompts(np.random.default_rng(10_000 + config.seed),
                                     max(num_eval, 1))

  def eval_greedy(p):
    if not num_eval:
      return None
    r = greedy(p, eval_prompts, jax.random.key(0))
    return float(task.reward(eval_prompts, r.completion_BC, r.lengths_B).mean())

  summary['greedy_reward_before_rl'] = eval_greedy(params)
  if num_eval:
    print(f"greedy reward after warm start: "
          f"{summary['greedy_reward_before_rl']:.3f}", flush=True)
  tx = step_lib.make_optimizer(rl.learning_rate, rl.grad_clip, rl.weight_decay)
  state = step_lib.init_train_state(graphdef, params, tx, mesh,
                                    with_ref=rl.beta > 0)
  start = 0
  if restored is not None and restored['phase'] == 'rl':
    state = dataclasses.replace(state, opt_state=ckpt.restore_opt_state(
        restored['step'], state.opt_state), step=jnp.asarray(restored['step']))
    start = restored['step']
  rl_step = step_lib.make_rl_step(tx, num_generations=num_gen,
                                  eps_low=rl.eps_low, eps_high=rl.eps_high,
                                  beta=rl.beta,
                                  indexer_loss_coef=mcfg.msa_indexer_loss_coef,
                                  balance_loss_coef=mcfg.aux_loss_coef)
  pcfg = config.planner
  topo, cost = planner_setup(config)
  identity = placement_lib.identity_placement(num_moe, num_experts, d_ep, spd)
  planner = planner_lib.StepPlanner(pcfg.method, topo, cost, identity,
                                    deadline_s=pcfg.deadline_ms / 1e3)
  batch_size = rl.prompts_per_step * num_gen
  seq_in = task.sequence_len - 1
  buckets = config_lib.capacity_buckets(
      batch_size // num_mb * seq_in // (d_ep * d_data), mcfg.top_k,
      d_ep, config.parallel.capacity_factors)

  rewards_hist = []
  for step in range(start, rl.steps):
    t_step = time.perf_counter()
    prompts = task.sample_prompts(rng, rl.prompts_per_step)
    key, k_sample = jax.random.split(key)
    t0 = time.perf_counter()
    rollout = sampler(state.params, prompts, k_sample)
    sample_s = time.perf_counter() - t0
    rewards = task.reward(np.repeat(prompts, num_gen, axis=0),
                          rollout.completion_BC, rollout.lengths_B)
    routes_in = rollout.routes_LBTK[:, :, :-1]
    valid_in = rollout.valid_BT[:, :-1]
    mbs = composition.compose_microbatches(
        batch_size, num_mb, routes=routes_in, valid=valid_in,
        num_experts=num_experts, balance=rl.balance_microbatches,
        seed=config.seed + step)
    loads_MLDE = loads_lib.microstep_loads(routes_in, valid_in, mbs,
                                           num_experts, d_data, d_ep)
    t0 = time.perf_counter()
    plan = planner.plan(loads_MLDE)
    plan_s = time.perf_counter() - t0
    cells = [placement_lib.cell_counts(loads_MLDE[m], plan.microstep(m)).max()
             for m in range(num_mb)]
    cells_static = [placement_lib.cell_counts(loads_MLDE[m], identity).max()
                    for m in range(num_mb)]
    capacity = config_lib.pick_bucket(int(max(cells)), buckets)
    batch = rl_batch_from_rollout(rollout, rewards, mbs)
    t0 = time.perf_counter()
    state, m = rl_step(state, batch, step_lib.StepPlan(
        jax.tree.map(jnp.asarray, plan.placement), capacity))
    m = jax.device_get(m)
    update_s = time.perf_counter() - t0
    mom = [float(placement_lib.max_over_mean(placement_lib.device_loads(
        loads_MLDE[i], plan.microstep(i))).mean()) for i in range(num_mb)]
    mom_static = [float(placement_lib.max_over_mean(placement_lib.device_loads(
        loads_MLDE[i], identity)).mean()) for i in range(num_mb)]
    rewards_hist.append(float(rewards.mean()))
    record = dict(
        phase='rl', reward_mean=float(rewards.mean()),
        reward_std=float(rewards.std()), kl=float(m['kl']),
        loss=float(m['loss']), clip_frac=float(m['clip_frac']),
        indexer_loss=float(m['indexer_loss']),
        grad_norm=float(m['grad_norm']), completion_len=float(
            rollout.lengths_B.mean()),
        microstep_max_over_mean=mom, microstep_max_over_mean_static=mom_static,
        capacity=capacity, capacity_static=config_lib.pick_bucket(
            int(max(cells_static)), buckets),
        dropped=int(m['dropped']), planner=pcfg.method,
        plan_fallbacks=planner.num_fallbacks,
        moves_per_device_per_microstep=float(plan.moves_MLD.mean()),
        replay_logp_gap=float(m.get('rollout_vs_recompute_logp_max_abs', 0.0)),
        sample_s=sample_s, plan_s=plan_s, update_s=update_s,
        step_s=time.perf_counter() - t_step)
    writer.write(step + 1, record)
    print(_log_line(step + 1, record), flush=True)
    if (step + 1) % config.get('checkpoint_every', 10) == 0 or step + 1 == rl.steps:
      ckpt.save(step + 1, state.params, phase='rl', opt_state=state.opt_state)

  summary['greedy_reward_after_rl'] = eval_greedy(state.params)
  k = max(1, min(5, len(rewards_hist) // 3))
  summary.update(
      reward_first=float(np.mean(rewards_hist[:k])) if rewards_hist else None,
      reward_last=float(np.mean(rewards_hist[-k:])) if rewards_hist else None,
      plan_fallbacks=planner.num_fallbacks)
  planner.close()
  writer.close()
  with open(os.path.join(workdir, 'summary.json'), 'w') as f:
    json.dump(summary, f, indent=1)
  summary['plots'] = metrics_lib.plot_metrics(workdir)
  return summary
