"""A short end-to-end run of the main job: files appear and reward rises."""
import glob
import importlib
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

import conftest
from foremoe_jax.foresight import expert_load
from foremoe_jax.rl import trainer
from foremoe_jax.utils import tensorboard


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
# 20 RL steps: two blocks of 10 for the reward's rise, two sample logs, a
# checkpoint in between (checkpoint_every) and one at the end. Rungs 2x
# apart, and two pair buckets for the emulated exchange: the balanced
# steps share one or two update programs instead of compiling one per
# bucket they touch.
OVERRIDES = {'task': 'sort', 'warmstart.steps': 100, 'rl.steps': 20,
             'checkpoint_every': 10, 'eval_prompts': 0,
             'parallel.capacity_growth': 2.0, 'parallel.cell_growth': 100.0}


def _train(workdir, **over):
  """The main job's command on configs/tiny.py with OVERRIDES; its stdout.

  A subprocess with the flags for runs (conftest.CPU_RUN_XLA_FLAGS): 100
  warm-start and 20 RL steps are bound by running, not compiling. The
  runs share the test run's compilation cache, so a resumed run compiles
  nothing."""
  flags = [f'--config.{k}={v}' for k, v in {**OVERRIDES, **over}.items()]
  out = subprocess.run(
      [sys.executable, '-m', 'experiments.rl_train', '--config=configs/tiny.py',
       *flags, f'--workdir={workdir}'], cwd=ROOT, capture_output=True,
      text=True, timeout=900, env=conftest.cpu_run_env(ROOT))
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
  return out.stdout


def test_short_run_reward_rises_and_writes_outputs(tmp_path):
  cfg = importlib.import_module('configs.tiny').get_config()
  cfg.update_from_flattened_dict(OVERRIDES)
  workdir = str(tmp_path)
  out = _train(workdir)
  lines = [json.loads(l) for l in open(os.path.join(workdir, 'metrics.jsonl'))]
  rl = [l for l in lines if l.get('phase') == 'rl']
  assert len(rl) == 20
  # Every compile of a step program is logged with the buckets of the step
  # that caused it: the first step's, and each update bucket the run had
  # not compiled before (a new static shape: it must compile).
  compiles = re.findall(r'compiled (.*) at step (\d+) \(capacity (\d+), '
                        r'recompute (\d+)\)', out)
  assert compiles and compiles[0][1] == '1', out[-2000:]
  for names, step, cap, rcap in compiles:
    r = rl[int(step) - 1]
    assert (int(cap), int(rcap)) == (r['capacity'],
                                     r['capacity_recompute']), names
  compiled_update = {int(s) for n, s, _, _ in compiles if 'update ' in n}
  seen = set()
  for r in rl:
    if r['capacity'] not in seen:
      seen.add(r['capacity'])
      assert r['step'] in compiled_update, (r['step'], r['capacity'])
  for key in ('step', 'reward_mean', 'kl', 'step_s', 'microstep_max_over_mean',
              'plan_wait_s', 'recompute_s', 'update_s',
              'weight_bytes_moved_per_device_per_microstep'):
    assert key in rl[0], key
  # Every slot held the expert its plan routed to (the ids travel with the
  # weights), and the plans moved weights: the engine is in the loop.
  assert all(l['transfer_id_errors'] == 0 for l in rl)
  assert sum(l['weight_bytes_moved_per_device_per_microstep'] for l in rl) > 0
  assert np.mean([np.mean(l['microstep_max_over_mean']) for l in rl]) < \
      np.mean([np.mean(l['microstep_max_over_mean_static']) for l in rl])
  rewards = np.array([l['reward_mean'] for l in rl])
  assert rewards[-10:].mean() > rewards[:10].mean() + 0.03, rewards
  # Replay reproduces the sampler's log-probs: the policy it trains on is the
  # policy that sampled.
  assert max(l['replay_logp_gap'] for l in rl) < 1e-4
  assert all(l['dropped'] == 0 for l in rl)
  # Each step flags its own plan fallback (whole or some layers), with a
  # reason and the layers it cost; the flags add up to the run's counters.
  assert all(l['plan_fallback'] == bool(l['plan_fallback_reason'])
             == (l['plan_fallback_layers'] > 0) for l in rl)
  assert sum(l['plan_fallback'] for l in rl) == (
      rl[-1]['plan_fallbacks'] + rl[-1]['plan_layer_fallbacks'])
  for png in ('reward.png', 'microstep_load.png'):
    with open(os.path.join(workdir, png), 'rb') as f:
      assert f.read(8) == b'\x89PNG\r\n\x1a\n'
  assert os.path.isdir(os.path.join(workdir, 'checkpoints', '20'))
  # Every 10 steps (the config's sample_log_every), 4 decoded samples with
  # the verifier's reference: for sorting, the prompt's digits sorted.
  samples = [json.loads(l) for l in open(os.path.join(workdir,
                                                      'samples.jsonl'))]
  assert [r['step'] for r in samples] == [10, 20]
  for r in samples:
    assert len(r['samples']) == 4
    for smp in r['samples']:
      assert smp['reference'] == ''.join(sorted(smp['prompt'].rstrip('=')))
      if smp['reward'] == 1.0:  # (A 0 may still decode alike: ids vs text.)
        assert smp['completion'] == smp['reference'] and smp['finished']
  # ... and TensorBoard's Text tab holds them too.
  events = b''.join(open(p, 'rb').read() for p in glob.glob(
      os.path.join(workdir, 'tensorboard', 'rl', 'events.out.tfevents.*')))
  assert b'rl/samples' in events
  assert f"| {samples[-1]['samples'][0]['prompt']} |".encode() in events
  assert os.path.exists(os.path.join(workdir, 'warmstart.png'))
  # TensorBoard holds the same run: every RL step, the warm start, and the
  # per-device load of each micro-step.
  tags = tensorboard.read_scalars(os.path.join(workdir, 'tensorboard', 'rl'))
  assert [s for s, _ in tags['rl/reward_mean']] == list(range(1, 21))
  np.testing.assert_allclose([v for _, v in tags['rl/reward_mean']],
                             [l['reward_mean'] for l in rl], rtol=1e-6)
  warm = tensorboard.read_scalars(
      os.path.join(workdir, 'tensorboard', 'warmstart'))
  assert [s for s, _ in warm['warmstart/sft_loss']] == [50, 100]
  assert len(tags['rl/device_load_max_over_mean/microstep_0']) == 20
  assert len(rl[0]['device_load_MD']) == cfg.rl.num_microbatches
  # Per-expert load from the foresight: the compact form in metrics.jsonl,
  # the whole [L, E] matrix in expert_load.jsonl (each MoE layer's row sums
  # to its routed tokens x top_k, every layer the same), the heatmap in
  # TensorBoard, expert_load.png at the end.
  steps_S, tokens_SLE = expert_load.read(workdir)
  assert steps_S.tolist() == list(range(1, 21))
  num_moe = len(rl[0]['expert_hot_share'])
  assert tokens_SLE.shape[1:] == (num_moe, cfg.model.num_experts)
  per_layer_SL = tokens_SLE.sum(axis=2)
  assert (per_layer_SL == per_layer_SL[:, :1]).all()
  assert (per_layer_SL[:, 0] % cfg.model.top_k == 0).all()
  for r, tokens_LE in zip(rl, tokens_SLE):
    assert r['expert_hot_share'] == expert_load.summary(
        tokens_LE)['expert_hot_share']
    assert 'expert_tokens_LE' not in r
  assert b'rl/expert_load_heatmap' in events
  assert os.path.exists(os.path.join(workdir, 'expert_load.png'))

  # A rerun in the same workdir (as after a crash) resumes from the latest
  # checkpoint: no second warm start, RL continues at step 21.
  out = _train(workdir, **{'rl.steps': 21})
  assert 'warm start ' not in out
  summary = json.loads(out.strip().splitlines()[-1])
  steps = [json.loads(l)['step'] for l in open(os.path.join(workdir,
                                                              'metrics.jsonl'))]
  assert steps == list(range(1, 22))
  assert expert_load.read(workdir)[0].tolist() == list(range(1, 22))
  warm = open(os.path.join(workdir, 'warmstart.jsonl')).read().splitlines()
  assert len(warm) == 2  # 100 steps logged every 50: written once only.

  # The summary covers the whole run, the steps before the restart included.
  assert summary['rl_steps_logged'] == 21
  assert summary['reward_first'] is not None and summary['reward_last'] > \
      summary['reward_first']

  # Rerunning a finished run changes nothing: no step, no summary of nulls.
  path = os.path.join(workdir, 'summary.json')
  before = open(path, 'rb').read()
  cfg.rl.steps = 21
  again = trainer.train(cfg, workdir)
  assert again['complete'] and again['step'] == 21
  assert open(path, 'rb').read() == before
  assert again['summary']['reward_last'] == summary['reward_last']
  assert len(open(os.path.join(workdir, 'metrics.jsonl')).readlines()) == 21


def test_samples_for_log_decodes_the_first_sample_of_each_prompt():
  """Against the task's own decode and references; a task that keeps no
  reference text logs None instead of failing the step."""
  import types  # pylint: disable=g-import-not-at-top
  from foremoe_jax.tasks import get_task  # pylint: disable=g-import-not-at-top
  task = get_task('sort')
  prompts = task.sample_prompts(0, 5)
  num_gen = 2
  tgt, _ = task.targets(prompts)
  comp = np.repeat(tgt, num_gen, axis=0)
  comp[1::2] = comp[1::2][:, ::-1]  # The second sample of each prompt differs.
  ro = types.SimpleNamespace(completion_BC=comp,
                             lengths_B=np.full(10, comp.shape[1]),
                             done_B=np.ones(10, bool))
  rewards = np.arange(10, dtype=np.float32)
  ctx = types.SimpleNamespace(
      config=types.SimpleNamespace(rl=types.SimpleNamespace(
          num_generations=num_gen)), task=task)
  got = trainer.samples_for_log(ctx, prompts, ro, rewards)
  assert len(got) == 4
  for i, smp in enumerate(got):
    assert smp['prompt'] == task.decode(prompts[i])
    assert smp['completion'] == smp['reference'] == task.answers(prompts)[i]
    assert smp['reward'] == 2 * i and smp['finished']

  class NoReferences(type(task)):
    def references(self, prompts_NP):
      raise NotImplementedError
  ctx.task = NoReferences(num_digits=4)
  assert [s['reference'] for s in trainer.samples_for_log(
      ctx, prompts, ro, rewards)] == [None] * 4


def test_compose_evens_device_tokens_only_when_asked():
  """rl.balance_device_tokens reorders each micro-batch so its devices hold
  even token counts (counted here from the valid mask); off, the order is
  the composition's own. rl.balance_step_tokens chooses the micro-steps
  too."""
  import types  # pylint: disable=import-outside-toplevel
  cfg = importlib.import_module('configs.tiny').get_config()
  cfg.rl.num_microbatches = 2
  num_dev = cfg.parallel.num_data * cfg.parallel.num_expert
  rng = np.random.default_rng(0)
  b, t = 4 * num_dev, 40
  lengths = np.where(np.arange(b) < num_dev, t, rng.integers(5, 10, b))
  ro = types.SimpleNamespace(valid_BT=np.arange(t)[None] < lengths[:, None],
                             tokens_BT=np.zeros((b, t), np.int32))
  ctx = types.SimpleNamespace(config=cfg)
  per_dev = lambda mbs: np.stack([
      (ro.valid_BT[:, :-1].sum(1))[mb].reshape(num_dev, -1).sum(1)
      for mb in mbs])
  cfg.rl.balance_step_tokens = False
  cfg.rl.balance_device_tokens = False
  plain = trainer.compose(ctx, ro, 0)
  cfg.rl.balance_device_tokens = True
  even = trainer.compose(ctx, ro, 0)
  for a, c in zip(plain, even):
    np.testing.assert_array_equal(np.sort(a), np.sort(c))
  # In order, the long samples sit on the first devices of micro-batch 0.
  assert per_dev(plain)[0].max() >= 2 * t - 2
  assert per_dev(even).max() < per_dev(plain).max()
  assert per_dev(even)[0].max() <= t - 1 + 9
  # Long samples in both micro-batches (every fourth): each micro-step
  # waits for a long one. Over the step, they share micro-step 0, one a
  # device, and micro-step 1 holds only short ones: the sum of the
  # busiest devices drops, and the step's samples are the same.
  long_B = np.arange(b) % 4 == 0
  lengths = np.where(long_B, t, rng.integers(5, 10, b))
  ro.valid_BT = np.arange(t)[None] < lengths[:, None]
  even = trainer.compose(ctx, ro, 0)
  cfg.rl.balance_step_tokens = True
  step = trainer.compose(ctx, ro, 0)
  np.testing.assert_array_equal(np.sort(np.concatenate(step)), np.arange(b))
  assert long_B[step[0]].sum() == num_dev
  assert per_dev(step)[1].max() < t - 1
  assert per_dev(step).max(1).sum() < per_dev(even).max(1).sum()


def test_routes_gather_into_micro_batches_sharded_one_layer_at_a_time():
  """The sampler's sharded routing record is gathered into micro-batch
  order on device: the values numpy's gather gives, laid out as the RL
  batch lays them out (each device its own rows), and no device ever holds
  more than one layer's whole record (every all-gather of the compiled
  program is at most one layer's [B, T, K])."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  from foremoe_jax.model import expert_parallel as ep  # pylint: disable=import-outside-toplevel
  from foremoe_jax.utils import hlo  # pylint: disable=import-outside-toplevel
  mesh = ep.make_mesh(2, 4)
  rows = (ep.DATA, ep.EXPERT)
  num_layers, num_b, num_t, top_k = 6, 32, 9, 2
  rng = np.random.default_rng(0)
  routes = rng.integers(0, 16, (num_layers, num_b, num_t, top_k)).astype(
      np.int32)
  mb_Mb = np.stack(np.split(rng.permutation(num_b), 4)).astype(np.int32)
  on_device = jax.device_put(routes, NamedSharding(mesh, P(None, rows)))
  got = trainer._routes_by_microbatch(on_device, jnp.asarray(mb_Mb))  # pylint: disable=protected-access
  want = np.moveaxis(routes[:, :, :-1][:, mb_Mb], 1, 0)
  np.testing.assert_array_equal(np.asarray(got), want)
  assert got.sharding.is_equivalent_to(
      NamedSharding(mesh, P(None, None, rows)), got.ndim)
  text = trainer._routes_gather(mesh).lower(  # pylint: disable=protected-access
      on_device, jnp.asarray(mb_Mb)).compile().as_text()
  layer = num_b * num_t * top_k
  assert all(n <= layer for _, n in hlo.all_gathers(text)), (
      hlo.all_gathers(text))
