"""The GPU benchmark's own code, dry-run on CPU (kernels in interpret mode,
XLA dense attention), so `make gpu-check` does not meet its first Python
error on a rented GPU: the soft deadline skips what is left yet still
returns a summary that the docs' table renders, a broken kernel costs only
its own timing, and the benchmark's vectorised margin rule equals the
tests' loop. That every phase runs and reports is checked on the bench
that `make gpu-check`'s dry run runs (tests/test_gpu_check.py), the same
run at the same shapes.
"""
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import render_results
import msa_testlib as lib
from pallas_kernels.msa import benchmark_gpu as bg
from pallas_kernels.msa import reference as ref

TINY = bg.GPUBench(**bg.DRY_RUN)


def test_past_the_deadline_everything_is_skipped_but_summarised(tmp_path):
  rows = []
  out = bg.run(TINY, log=rows.append, deadline=time.monotonic() - 1.0)
  assert not out['complete']
  assert all(r.get('skipped') == 'deadline' for r in rows), rows
  assert out['max_len'] is None and out['decode_len'] is None
  summary = {'gpu_check': 'fail', 'setup': {}, 'tests': {},
             'bench_msa': out}
  (tmp_path / 'gpu_check_cut.json').write_text(json.dumps(summary))
  text = render_results.render_gpu_check(str(tmp_path), 'gpu_check_cut')
  assert ('Not measured: prefill 128 (deadline); decode 128 (deadline);'
          ' train 128 (deadline)') in text


def test_a_broken_kernel_costs_only_its_own_timing(tmp_path, monkeypatch):
  # A GPU call gets one try: a kernel that fails to lower is reported in
  # its row, and everything else in that row is still timed and rendered.
  real = bg.pallas_path.sparse_attention

  def token_kernel_fails(*args, **kw):
    kernels = args[9] if len(args) > 9 else kw.get('gpu_kernels')
    if kernels == 'token':
      raise RuntimeError('planted lowering failure')
    return real(*args, **kw)

  monkeypatch.setattr(bg.pallas_path, 'sparse_attention', token_kernel_fails)
  # Only prefill and train launch the per-token kernels: the other phases
  # are stubbed, and the score launch's variants left out (the full run is
  # tests/test_gpu_check.py's; not what this test is about).
  monkeypatch.setattr(bg, 'ceilings', lambda cfg: {'matmul_n': 1})
  monkeypatch.setattr(bg, 'check', lambda cfg: {})
  monkeypatch.setattr(bg, 'tune', lambda cfg, clock: {'tune_len': 1})
  monkeypatch.setattr(bg, 'decode',
                      lambda cfg, s, impl, tuned: {'cache_len': s})
  monkeypatch.setattr(bg, 'profile', lambda cfg, t, impl: {'profiles': {}})
  monkeypatch.setattr(bg, 'mosaic', lambda cfg, t: {})
  monkeypatch.setattr(bg, 'INDEX_VARIANTS', ())
  out = bg.run(TINY, log=lambda row: None)
  pre = out['results'][0]
  assert set(pre['kernel_errors']) == {'main_token', 'msa_train_token'}
  assert 'planted lowering failure' in pre['kernel_errors']['main_token']
  for key in ('dense_s', 'msa_s', 'index_s', 'main_s', 'msa_train_s'):
    assert pre[key] > 0, key
  # (rows are rounded to 6 decimals)
  assert pre['speedup'] == pytest.approx(pre['dense_s'] / pre['msa_s'],
                                         rel=1e-2)
  assert 'main_token_s' not in pre and 'main_speedup_vs_token' not in pre
  assert not out['complete'] and out['prefill_speedup_at_max_len'] > 0
  summary = {'gpu_check': 'fail', 'setup': {}, 'tests': {},
             'bench_msa': out}
  (tmp_path / 'gpu_check_broken.json').write_text(json.dumps(summary))
  text = render_results.render_gpu_check(str(tmp_path), 'gpu_check_broken')
  assert 'main_token at 128 (RuntimeError: planted lowering failure)' in text


def test_a_tuned_forward_is_timed_beside_the_default(monkeypatch):
  # Timings a tuned forward does not join are left out (not what this
  # test is about): the score launch's tilings, the decode score launch's
  # blocks per program and, with train_max_len and fused_max_len below
  # 128, the union tiles, the stages apart and the kernels they replaced.
  monkeypatch.setattr(bg, 'INDEX_VARIANTS', ())
  monkeypatch.setattr(bg, 'DECODE_BLOCKS_PER_PROGRAM', ())
  cfg = dataclasses.replace(TINY, train_max_len=64, fused_max_len=64)
  tuned = bg.kv_outer.ForwardConfig(pair_order=True, prefetch=True)
  assert bg.tuned_config({'best': tuned.label()}) == tuned
  assert bg.tuned_config({}) is None
  pre = bg.prefill(cfg, 128, tuned)
  for key in ('main_s', 'main_tuned_s', 'msa_s', 'msa_tuned_s'):
    assert pre[key] > 0, key
  tr = bg.train(cfg, 128, tuned)
  for key in ('msa_train_s', 'msa_train_tuned_s'):
    assert tr[key] > 0, key
  assert tr['train_speedup_tuned'] == pytest.approx(
      tr['dense_train_s'] / tr['msa_train_tuned_s'], rel=1e-6)
  assert pre['tuned_config'] == tuned.label()
  assert pre['speedup_tuned'] == pytest.approx(
      pre['dense_s'] / pre['msa_tuned_s'], rel=1e-6)
  dec = bg.decode(cfg, 128, 'xla', tuned)
  ends = {k[len('decode_'):-2]: v for k, v in dec.items()
          if k.startswith('decode_msa') and k.endswith('_s')}
  assert set(ends) == {'msa', 'msa_xla_topk', 'msa_tiled_decode',
                       'msa_tuned', 'msa_tuned_xla_topk'}
  assert dec['decode_best'] == min(ends, key=ends.get)
  assert dec['decode_speedup_best'] == pytest.approx(
      dec['decode_dense_s'] / min(ends.values()), rel=1e-6)


def test_the_tune_phase_stops_at_its_budget():
  row = bg.tune(dataclasses.replace(TINY, tune_budget_s=0.0), bg._Clock(None))
  assert row['speedup_vs_default'] == {} and 'best' not in row
  assert row['not_timed'] == [c.label() for c in bg.TUNE]
  assert bg.tuned_config(row) is None


def test_a_variant_that_computes_something_else_never_counts(monkeypatch):
  # However fast, a variant whose output differs from the default's is
  # reported as wrong and never becomes the tuned forward.
  bad = bg.kv_outer.ForwardConfig(num_warps=2)
  monkeypatch.setattr(bg, 'TUNE', (bad,))
  real = bg._main_branch

  def planted(cfg, off, config=None, **kw):
    f = real(cfg, off, config, **kw)
    if config != bad:
      return f
    return lambda *a: (f(*a)[0] + 0.5, f(*a)[1])

  monkeypatch.setattr(bg, '_main_branch', planted)
  row = bg.tune(TINY, bg._Clock(None))
  assert row['wrong'] == [bad.label()]
  assert row['max_abs_diff_vs_default'][bad.label()] == pytest.approx(0.5,
                                                                      rel=0.05)
  assert row['speedup_vs_default'] == {} and bg.tuned_config(row) is None


def test_vectorised_margin_rule_equals_the_loop():
  b, t, s, g, di, c, k = 2, 96, 96, 2, 8, 16, 4
  _, _, _, qi, ki, _ = lib.make_inputs(b, t, s, g, 1, 8, di, seed=4)
  scores = ref.block_scores_BGTN(ref.index_logits_BGTS(qi, ki), c)
  exact = ref.select_blocks_BGTK(scores, block_size=c, top_k=k)
  rng = np.random.default_rng(0)
  for eps_scale in (2.0**-7, 0.05):
    sels = [np.asarray(exact)]
    # Rows perturbed: a kept earlier block swapped for one left out.
    bad = np.array(exact)
    for _ in range(40):
      bb, gg, tt = rng.integers(b), rng.integers(g), rng.integers(2 * c, t)
      local, row = tt // c, bad[bb, gg, tt]
      out = np.setdiff1d(np.arange(local), row)
      if out.size:
        row[rng.integers(min(local, k - 1))] = rng.choice(out)
    sels.append(bad)
    for sel in sels:
      want = lib.selection_margin_report(sel, scores, qi, ki, c, k, 0,
                                         eps_scale=eps_scale)
      got = bg.selection_margin(sel, np.asarray(scores, np.float64),
                                np.asarray(qi), np.asarray(ki), c, k,
                                eps_scale=eps_scale)
      assert got[0] == want[0], (eps_scale, got, want)
      np.testing.assert_allclose(got[1], want[1], rtol=1e-12)
  assert lib.selection_margin_report(bad, scores, qi, ki, c, k, 0)[0] > 0


def test_targets_read_the_rows_they_name():
  bench = {'results': [{'seq_len': 32768, 'speedup': 2.6, 'flop_ratio': 6.4,
                        'train_speedup_main_only': 1.5},
                       {'seq_len': 131072, 'speedup': 3.0}],
           'decode': [{'cache_len': 131072, 'decode_speedup': 5.0,
                       'decode_flop_ratio': 21.3}]}
  got = {t['what']: (t['measured'], t['met']) for t in bg.targets(bench)}
  assert got == {'prefill 32k': (2.6, True), 'prefill 128k': (3.0, False),
                 'decode 128k, batch 8': (5.0, True),
                 'forward+backward 32k (main branch)': (1.5, False)}
  # A variant's speedup counts as the best only when it is higher.
  bench['results'][1]['speedup_tuned'] = 7.5
  bench['decode'][0]['decode_speedup_best'] = 5.0
  bench['results'][0]['speedup_tuned'] = 2.4
  best = {t['what']: (t['best'], t['best_met']) for t in bg.targets(bench)}
  assert best == {'prefill 32k': (2.6, True), 'prefill 128k': (7.5, True),
                  'decode 128k, batch 8': (5.0, True),
                  'forward+backward 32k (main branch)': (1.5, False)}
  # fp8 index scores are reported beside, never as the best.
  bench['results'][1]['speedup_fp8'] = 9.0
  fp8 = {t['what']: (t['best'], t['with_fp8_index'])
         for t in bg.targets(bench)}
  assert fp8['prefill 128k'] == (7.5, 9.0)
  assert fp8['prefill 32k'] == (2.6, None)
  assert fp8['decode 128k, batch 8'][1] is None
  # A length the run never reached is unmeasured, not failed silently.
  assert all(t['measured'] is None and not t['met']
             for t in bg.targets({'results': [], 'decode': []}))


def test_the_cheaper_targets_are_measured_first():
  # The lent GPU's run: the 32k prefill, then decode at 128k, then
  # forward+backward at 32k, the costly 128k prefill, then a trace of
  # one call each (a diagnostic, no target), and last the Mosaic GPU
  # kernels beside the Triton ones (never run on a GPU before).
  cfg = bg.GPUBench(seq_lens=(32768, 131072), decode_lens=(131072,))
  assert bg.schedule(cfg) == [('prefill', 32768), ('decode', 131072),
                              ('train', 32768), ('prefill', 131072),
                              ('profile', 32768), ('mosaic', 32768),
                              ('mosaic', 131072)]
  # Every target's length is measured by some phase of the schedule.
  lengths = {(p, n) for p, n in bg.schedule(cfg)}
  for _, phase, n, *_ in bg.TARGETS:
    assert ('decode' if phase == 'decode' else 'prefill', n) in lengths


def test_a_run_cut_by_its_time_limit_still_reports_the_targets_it_reached(
    tmp_path, monkeypatch):
  # Stub phases (no kernels): the soft deadline falls after the third
  # measuring phase, and the hard timeout kills the bench inside the
  # fourth, so only the rows it printed survive (gpu_check_summary keeps
  # them as 'partial'). The targets measured before the cut are in the
  # rendered table.
  calls = []

  def stub(name, **fields):
    def fn(cfg, n, *rest):
      calls.append((name, n))
      return {'seq_len' if name != 'decode' else 'cache_len': n, **fields}
    return fn

  monkeypatch.setattr(bg, 'ceilings', lambda cfg: {'matmul_n': 1})
  monkeypatch.setattr(bg, 'check', lambda cfg: {})
  monkeypatch.setattr(bg, 'tune', lambda cfg, clock: {'tune_len': 1})
  monkeypatch.setattr(bg, '_decode_impl', lambda cfg: 'xla')
  monkeypatch.setattr(bg, 'prefill', stub(
      'prefill', dense_s=0.026, msa_s=0.01, speedup=2.6, flop_ratio=6.4,
      spread={'msa': 0.1}))
  monkeypatch.setattr(bg, 'decode', stub(
      'decode', decode_dense_s=7e-4, decode_msa_s=1.4e-4,
      decode_speedup=5.0, decode_flop_ratio=21.3))
  monkeypatch.setattr(bg, 'train', stub(
      'train', dense_train_s=0.1, msa_train_s=0.05,
      train_speedup_main_only=2.0, spread={'msa_train': 0.2},
      kernel_errors={'bwd_dkv_prefetch': 'planted'}))

  class Clock(bg._Clock):
    """Past the deadline once three measuring phases have run."""

    def ok(self):
      return len(calls) < 3

  monkeypatch.setattr(bg, '_Clock', Clock)
  cfg = bg.GPUBench(seq_lens=(32768, 131072), decode_lens=(131072,))
  printed = []
  out = bg.run(cfg, log=printed.append)
  assert calls == [('prefill', 32768), ('decode', 131072), ('train', 32768)]
  assert [r['phase'] for r in printed][3:] == ['prefill', 'decode', 'train',
                                              'prefill', 'profile', 'mosaic',
                                              'mosaic']
  assert all(r['skipped'] == 'deadline' for r in printed[-4:])
  assert not out['complete']
  # The final JSON: the train fields joined the 32k prefill row, and both
  # spreads survive.
  row32 = out['results'][0]
  assert row32['train_speedup_main_only'] == 2.0
  assert row32['spread'] == {'msa': 0.1, 'msa_train': 0.2}
  assert row32['kernel_errors'] == {'bwd_dkv_prefetch': 'planted'}
  assert row32['phase'] == 'prefill' and row32['train_elapsed_s'] >= 0
  want = {'prefill 32k': 2.6, 'prefill 128k': None,
          'decode 128k, batch 8': 5.0,
          'forward+backward 32k (main branch)': 2.0}
  assert {t['what']: t['measured'] for t in bg.targets(out)} == want
  # Killed inside the 128k prefill: only the printed rows before it.
  partial = {'error': 'no final JSON line in the bench log',
             'partial': printed[:-4]}
  assert {t['what']: t['measured'] for t in bg.targets(partial)} == want
  summary = {'gpu_check': 'fail', 'setup': {}, 'tests': {},
             'bench_msa': partial}
  (tmp_path / 'gpu_check_killed.json').write_text(json.dumps(summary))
  text = render_results.render_gpu_check(str(tmp_path), 'gpu_check_killed')
  assert 'The bench did not finish' in text
  assert '| prefill 32k | 6.40 | **2.60** | >= 2.50 | yes' in text, text
  assert '| decode 128k, batch 8 | 21.3 | **5.00** |' in text, text
  assert '| forward+backward 32k (main branch) | 6.40 | **2.00** |' in text
  assert '| prefill 128k | - | - |' in text, text


def test_the_stages_compose_to_the_branches_they_split():
  # What the bench times apart (index: scores, top-k; main: plan, kernel,
  # combine) is, run in a chain, what the 'index' and 'main' rows time:
  # the same selection, output and LSE.
  t = 128
  q, k, v, qi, ki = bg._inputs(TINY, 1, t, t)
  off = jnp.zeros((1,), jnp.int32)
  sel, _ = bg._selection(TINY, qi, ki, off, {})
  index = bg._index_stages(TINY, qi, ki, off)
  scores_fn, scores_args = index['index_scores']
  topk_fn, _ = index['index_topk']
  got_sel = jax.jit(topk_fn)(jax.jit(scores_fn)(*scores_args))
  np.testing.assert_array_equal(np.asarray(got_sel), np.asarray(sel))
  assert (np.asarray(sel)[..., 0] >= 0).all()
  stages = bg._forward_stages(TINY, off, q, k, v, sel)
  plan_fn, (sel_,) = stages['main_plan']
  kernel_fn, (_, *kernel_args) = stages['main_kernel']
  combine_fn, _ = stages['main_combine']
  plan = jax.jit(plan_fn)(sel_)
  out, lse_BTGR = jax.jit(combine_fn)(plan, jax.jit(kernel_fn)(plan,
                                                               *kernel_args))
  want_out, want_lse = jax.jit(bg._main_branch(TINY, off))(q, k, v, sel)
  b, _, h, d = q.shape
  r = TINY.heads_per_group
  got = out[:, :, :, :r, :d].reshape(b, t, h, d)
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.asarray(want_out, np.float32))
  got_lse = lse_BTGR[..., :r].reshape(b, t, h)
  np.testing.assert_array_equal(np.asarray(got_lse), np.asarray(want_lse))
  assert np.isfinite(np.asarray(want_lse)).all()


def test_scores_equal_tells_a_different_score_or_mask():
  a = [jnp.array([[[1.0, -jnp.inf], [2.0, 3.0]]])]
  assert bg.scores_equal(a, [a[0][:, :, :1], a[0][:, :, 1:]])
  assert not bg.scores_equal(a, [a[0].at[0, 1, 1].add(1e-3)])
  assert not bg.scores_equal(a, [a[0].at[0, 0, 1].set(0.0)])


def test_a_tile_shared_selection_is_a_valid_one_its_tiles_share():
  # The union tiles' best case: each tile of q_tile tokens (q_tile <= the
  # block size) gets its last token's blocks, which is still a selection
  # every token may make (distinct, visible, the local block last).
  b, t, s, g, r, d, di, c, k, o = 1, 64, 64, 2, 2, 16, 8, 16, 3, 0
  _, _, _, qi, ki, _ = lib.make_inputs(b, t, s, g, r, d, di)
  sel = ref.selection_BGTK(qi, ki, block_size=c, top_k=k, q_offset=o)
  for q_tile in (4, 16):
    shared = np.asarray(bg.tile_shared_selection(sel, q_tile))
    lib.check_selection_invariants(shared, c, o)
    tiles = shared.reshape(b, g, t // q_tile, q_tile, k)
    assert np.all(tiles == tiles[:, :, :, -1:])
    np.testing.assert_array_equal(tiles[:, :, :, -1],
                                  np.asarray(sel)[:, :, q_tile - 1::q_tile])
