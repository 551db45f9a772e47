"""Load traces (foresight.traces): calibration, structure, .npz round trip."""
import dataclasses

import numpy as np
import pytest

from foremoe_jax.foresight import traces


def test_qwen3_like_hottest_expert_share():
  """Step-level hottest expert: 4-6% at 128 experts, top-8 (Qwen3-30B-A3B)."""
  cfg = traces.SyntheticTraceConfig(num_steps=4, num_layers=8)
  trace = traces.synthetic_trace(cfg)
  share_RL = np.stack([traces.hottest_expert_share(trace.step(r))
                       for r in range(trace.num_steps)])
  assert 0.04 <= share_RL.mean() <= 0.06
  assert 0.03 <= share_RL.mean(axis=0).min()
  assert share_RL.mean(axis=0).max() <= 0.07
  # The skew differs per layer.
  assert np.ptp(share_RL.mean(axis=0)) > 0.005


def test_shapes_counts_and_determinism():
  cfg = traces.SyntheticTraceConfig(num_steps=2, num_microsteps=3, num_layers=2,
                                    num_experts=16, top_k=2, num_devices=4,
                                    seqs_per_microbatch=3, tokens_per_seq=64,
                                    tokens_per_seq_sigma=0.0,
                                    hot_share_range=(0.1, 0.15))
  trace = traces.synthetic_trace(cfg)
  assert trace.loads_RMLDE.shape == (2, 3, 2, 4, 16)
  # Every source holds 3 sequences of 64 tokens, top-2.
  np.testing.assert_array_equal(trace.loads_RMLDE.sum(axis=-1), 3 * 64 * 2)
  # No expert takes more than one selection per token of a sequence.
  assert trace.loads_RMLDE.max() <= 3 * 64
  np.testing.assert_array_equal(trace.loads_RMLDE,
                                traces.synthetic_trace(cfg).loads_RMLDE)
  other = traces.synthetic_trace(traces.SyntheticTraceConfig(
      **{**cfg.__dict__, 'seed': 1}))
  assert not np.array_equal(other.loads_RMLDE, trace.loads_RMLDE)


def test_microsteps_swing_more_than_steps():
  """Per-sequence correlation: a micro-step's expert mix strays far from its
  step's, while steps stay close to each other (what step-level balancers
  rely on and cannot follow within a step)."""
  trace = traces.synthetic_trace(traces.SyntheticTraceConfig(num_steps=2,
                                                            num_microsteps=16))
  loads = trace.loads_RMLDE.astype(np.float64).sum(axis=3)  # [R, M, L, E]
  micro = loads / loads.sum(-1, keepdims=True)
  step = loads.sum(1) / loads.sum((1, 3))[..., None]  # [R, L, E]
  tv_micro = 0.5 * np.abs(micro - step[:, None]).sum(-1).mean()
  tv_steps = 0.5 * np.abs(step[0] - step[1]).sum(-1).mean()
  assert tv_micro > 2.0 * tv_steps


def test_npz_round_trip(tmp_path):
  trace = traces.synthetic_trace(traces.SyntheticTraceConfig(
      num_steps=2, num_microsteps=2, num_layers=2, num_experts=16, top_k=2,
      num_devices=2, hot_share_range=(0.1, 0.15)))
  path = str(tmp_path / 'trace.npz')
  traces.save_trace(path, trace)
  back = traces.load_trace(path)
  np.testing.assert_array_equal(back.loads_RMLDE, trace.loads_RMLDE)
  assert back.meta == trace.meta
  assert back.meta['num_experts'] == 16


def test_trace_from_step_loads_and_config_checks():
  steps = [np.ones((2, 3, 4, 5), np.int64) * r for r in range(3)]
  trace = traces.trace_from_step_loads(steps, {'source': 'test'})
  assert trace.loads_RMLDE.shape == (3, 2, 3, 4, 5)
  np.testing.assert_array_equal(trace.step(2), steps[2])
  with pytest.raises(ValueError, match='M, L, D, E'):
    traces.trace_from_step_loads([np.ones((2, 3))])
  with pytest.raises(ValueError, match='hot_share_range'):
    traces.SyntheticTraceConfig(num_experts=16)


def test_routing_records_to_trace_to_planner(tmp_path):
  """(a) Real loads: routing record -> foresight.loads -> trace -> planner."""
  from foremoe_jax import placement as placement_lib
  from foremoe_jax.foresight import loads as loads_lib
  from foremoe_jax.planner import CostModel, Topology, plan_step

  rng = np.random.default_rng(0)
  num_layers, num_samples, num_tokens, top_k, num_experts = 2, 8, 16, 2, 8
  steps = []
  for _ in range(2):
    routes = np.stack([np.stack([rng.choice(num_experts, (num_tokens, top_k),
                                            replace=True)
                                 for _ in range(num_samples)])
                       for _ in range(num_layers)])
    micro = [np.array([2 * m, 2 * m + 1]) for m in range(4)]
    steps.append(loads_lib.microstep_loads(routes, None, micro, num_experts,
                                           d_data=1, d_ep=4))
  trace = traces.trace_from_step_loads(steps)
  path = str(tmp_path / 'record.npz')
  traces.save_trace(path, trace)
  trace = traces.load_trace(path)
  assert trace.loads_RMLDE.shape == (2, 4, num_layers, 4, num_experts)
  topo = Topology(1, 4, num_experts // 4 + 2)
  current = placement_lib.identity_placement(num_layers, num_experts, 4,
                                             topo.slots_per_device)
  plan = plan_step(trace.step(1), topo, CostModel(), current)
  for m in range(plan.num_microsteps):
    np.testing.assert_array_equal(
        placement_lib.device_loads(trace.step(1)[m], plan.microstep(m)),
        plan.loads_MLD[m])


def test_balanced_device_tokens_reorders_within_each_microstep():
  """balance_device_tokens lays the same sequences out differently: every
  micro-step's loads summed over devices are unchanged, and the busiest
  source device sends fewer rows (lengths are long-tailed)."""
  cfg = traces.SyntheticTraceConfig(num_steps=2, num_microsteps=4,
                                    num_layers=2, num_experts=32, top_k=2,
                                    num_devices=8, seqs_per_microbatch=4,
                                    tokens_per_seq=64, seed=3)
  plain = traces.synthetic_trace(cfg).loads_RMLDE
  even = traces.synthetic_trace(dataclasses.replace(
      cfg, balance_device_tokens=True)).loads_RMLDE
  np.testing.assert_array_equal(plain.sum(axis=3), even.sum(axis=3))
  sent = lambda x: x[:, :, 0].sum(-1)  # [R, M, D] rows a device sends.
  assert (sent(even).max(-1) <= sent(plain).max(-1)).all()
  assert sent(even).max(-1).mean() < sent(plain).max(-1).mean()


def test_balanced_step_tokens_recomposes_each_step():
  """balance_step_tokens moves sequences between the micro-steps of a step,
  never between steps: each step's loads summed over micro-steps and
  devices are unchanged, and the step's busiest senders, summed over its
  micro-steps, send fewer rows than with the layout-only balance."""
  cfg = traces.SyntheticTraceConfig(num_steps=2, num_microsteps=4,
                                    num_layers=2, num_experts=32, top_k=2,
                                    num_devices=8, seqs_per_microbatch=2,
                                    tokens_per_seq=64, seed=3)
  layout = traces.synthetic_trace(dataclasses.replace(
      cfg, balance_device_tokens=True)).loads_RMLDE
  step = traces.synthetic_trace(dataclasses.replace(
      cfg, balance_step_tokens=True)).loads_RMLDE
  np.testing.assert_array_equal(layout.sum(axis=(1, 3)), step.sum(axis=(1, 3)))
  assert not np.array_equal(layout.sum(axis=3), step.sum(axis=3))
  sent = lambda x: x[:, :, 0].sum(-1).max(-1).sum(-1)  # [R] busiest, summed.
  assert (sent(step) < sent(layout)).all()


def test_cap_simplex_caps_and_scales_the_rest_in_proportion():
  """min(cap, c p) summing to 1, against hand-computed rows: one entry over
  the cap gives its excess to the others in proportion; a one-hot row
  (nothing to scale) spreads it evenly, as a token's other choices must go
  somewhere; a row under the cap stays as it is."""
  cap = 0.25
  got = traces._cap_simplex(np.array([[0.7, 0.2, 0.1, 0.0, 0.0],
                                      [1.0, 0.0, 0.0, 0.0, 0.0],
                                      [0.2, 0.2, 0.2, 0.2, 0.2]]), cap)
  # Row 0: 0.7 -> 0.25; 0.2 and 0.1 scale by c until 0.2 c hits the cap too
  # (c = 1.25), then 0.1 takes the rest: 1 - 0.5 = 0.5 over 0.1 and ~0.
  np.testing.assert_allclose(got[0], [0.25, 0.25, 0.25, 0.125, 0.125],
                             atol=1e-9)
  np.testing.assert_allclose(got[1], [0.25, 0.1875, 0.1875, 0.1875, 0.1875],
                             atol=1e-9)
  np.testing.assert_allclose(got[2], [0.2] * 5, atol=1e-9)
  rng = np.random.default_rng(0)
  g = rng.standard_gamma(np.full((200, 64), 0.05))
  q = traces._cap_simplex(g / g.sum(1, keepdims=True), 1 / 8)
  assert q.max() <= 1 / 8 + 1e-12 and np.allclose(q.sum(1), 1)


def test_no_expert_takes_more_rows_than_its_sequences_have_tokens():
  """A token picks top_k distinct experts, so a device's load on one expert
  is at most its token count, in every layer and micro-step, however
  concentrated a sequence's routing (a small seq_concentration)."""
  cfg = traces.SyntheticTraceConfig(
      num_steps=2, num_microsteps=2, num_layers=3, num_experts=16, top_k=4,
      num_devices=4, seqs_per_microbatch=2, tokens_per_seq=64,
      seq_concentration=0.05, hot_share_range=(0.1, 0.15))
  loads = traces.synthetic_trace(cfg).loads_RMLDE
  tokens_RMD = loads[:, :, 0].sum(-1) // cfg.top_k
  assert (loads.sum(-1) == cfg.top_k * tokens_RMD[:, :, None]).all()
  assert (loads <= tokens_RMD[:, :, None, :, None]).all()
  assert (loads == tokens_RMD[:, :, None, :, None]).any()  # The cap binds.
