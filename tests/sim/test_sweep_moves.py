"""experiments.sweep_moves: its rows and summary against the grid they come
from, and its rendered table from a hand-made result."""
import pytest

from experiments import render_results, sweep_moves
from foremoe_jax.sim import cluster, hardware

# Mixtral's shape on one EP group of 8 (one expert home per device): fast
# to plan, and with a redundant slot ForeMoE's moves change its times.
MODEL, DEVICES, MICRO = 'mixtral_8x7b', 8, 2
TOKEN_CONFIGS = ((1, 32768), (2, 4096))
REDUNDANT = (0, 1)
QUIET = lambda *a, **k: None


@pytest.fixture(scope='module')
def sweep():
  return sweep_moves.run_sweep((MODEL,), (DEVICES,), hardware.H100, MICRO,
                               redundant=REDUNDANT,
                               token_configs=TOKEN_CONFIGS, log=QUIET)


def test_rows_cover_every_cell_and_match_their_grid_rows(sweep):
  rows, grid_rows = sweep
  cells = {(r['redundant_slots_per_device'], r['seqs_per_microbatch'],
            r['tokens_per_seq']) for r in rows}
  assert len(rows) == len(cells) == len(REDUNDANT) * len(TOKEN_CONFIGS)
  assert cells == {(r, s, t) for r in REDUNDANT for s, t in TOKEN_CONFIGS}
  for row in rows:
    assert not row['errors']
    by = {g['method']: g for g in grid_rows if g['key'] == row['key']}
    assert set(by) == set(sweep_moves.METHODS)
    for m in sweep_moves.METHODS:
      assert row['step_s'][m] == by[m]['step_s']
      assert row['update_s'][m] == by[m]['update_s']
    split, fm = by['foresight_split'], by['foremoe']
    assert row['foremoe_vs_foresight_split_step'] == pytest.approx(
        split['step_s'] / fm['step_s'], rel=1e-12)
    assert row['foremoe_vs_foresight_split_update'] == pytest.approx(
        split['update_s'] / fm['update_s'], rel=1e-12)
    # run_grid's own speedup column says the same.
    assert row['foremoe_vs_foresight_split_step'] == pytest.approx(
        fm['speedup_step_vs_foresight_split'], rel=1e-12)
    assert row['foremoe_transfer_exposed_s'] == fm['transfer_exposed_s']
    assert row['foremoe_minus_split_s']['all_to_all_s'] == pytest.approx(
        fm['all_to_all_s'] - split['all_to_all_s'])
    if row['redundant_slots_per_device'] == 0:
      # s = E / D: every expert has its one slot at home; nothing can be
      # replicated, so ForeMoE has nothing to move and its device side is
      # foresight_split's.
      assert row['foremoe_move_s'] == 0.0
      assert row['foremoe_vs_foresight_split_update'] == 1.0
  # The shapes are chosen so that the moves change the times somewhere.
  assert any(r['foremoe_move_s'] > 0
             and r['foremoe_vs_foresight_split_update'] != 1.0 for r in rows)


def test_update_times_match_an_independent_grid_run(sweep):
  """The device side is deterministic: a cell re-run through run_grid
  directly predicts the same update seconds for every method."""
  rows, _ = sweep
  row = [r for r in rows if r['redundant_slots_per_device'] == 1][0]
  again = cluster.run_grid(
      (MODEL,), (DEVICES,), (hardware.H100,), sweep_moves.METHODS,
      modes=('exact',), log=QUIET,
      work_kwargs=dict(num_microsteps=MICRO,
                       seqs_per_microbatch=row['seqs_per_microbatch'],
                       tokens_per_seq=row['tokens_per_seq'],
                       redundant_slots_per_device=1))
  for g in again:
    assert row['update_s'][g['method']] == pytest.approx(g['update_s'],
                                                         rel=1e-12)


def test_summary_counts_the_rows(sweep):
  rows, _ = sweep
  summ = sweep_moves.summarize(rows)
  ratios = [r['foremoe_vs_foresight_split_step'] for r in rows]
  assert summ['rows'] == summ['rows_scored'] == len(rows)
  assert summ['rows_where_moves_win'] == len([x for x in ratios if x > 1])
  assert summ['rows_where_moves_win_update'] == len(
      [r for r in rows if r['foremoe_vs_foresight_split_update'] > 1])
  assert summ['best_foremoe_vs_foresight_split_step'] == max(ratios)
  assert summ['min_foremoe_vs_foresight_split_step'] == min(ratios)
  best = [r for r in rows if r['key'] == summ['best_row_key']][0]
  assert best['foremoe_vs_foresight_split_step'] == max(ratios)
  assert summ['meets_1_05_in_some_row'] == (max(ratios) >= 1.05)
  assert summ['step_timing_noise_max'] == max(
      abs(r['foremoe_minus_split_s']['recompute_plan_s'])
      / r['step_s']['foremoe'] for r in rows)


def test_a_method_that_fails_is_recorded_not_raised():
  rows, _ = sweep_moves.run_sweep(
      (MODEL,), (DEVICES,), hardware.H100, MICRO, redundant=(1,),
      token_configs=((1, 64),), methods=('foresight_split', 'bogus'),
      log=QUIET)
  (row,) = rows
  assert 'bogus' in row['errors'] and 'unknown method' in row['errors']['bogus']
  assert row['step_s']['bogus'] is None
  assert row['step_s']['foresight_split'] > 0
  assert row['foremoe_vs_foresight_split_step'] is None
  summ = sweep_moves.summarize(rows)
  assert summ['rows_scored'] == 0 and summ['rows_with_errors'] == [row['key']]


def _hand_row(redundant, step_split, step_fm, errors=None):
  return dict(
      key=f'm/8dev/r{redundant}/1x64', model='m', devices=8, ep=8,
      redundant_slots_per_device=redundant, seqs_per_microbatch=1,
      tokens_per_seq=64, tokens_per_device=64,
      step_s={'static': 3.0, 'eplb_step': 2.5, 'foresight_split': step_split,
              'foremoe': step_fm},
      update_s={'static': 2.0, 'eplb_step': 1.5, 'foresight_split': 1.2,
                'foremoe': 1.1},
      plan_s={'static': 0.01, 'eplb_step': 0.02, 'foresight_split': 0.03,
              'foremoe': 0.04},
      foremoe_vs_foresight_split_step=step_split / step_fm,
      foremoe_vs_foresight_split_update=1.2 / 1.1,
      microstep_max_over_mean={'foresight_split': 1.25, 'foremoe': 1.07},
      errors=errors or {}, foremoe_transfer_exposed_s=0.125,
      foremoe_wire_bytes_over_useful=1.5, foremoe_move_s=0.25,
      foremoe_capacity=100,
      foremoe_minus_split_s={'moe_compute_s': -0.2, 'all_to_all_s': 0.05,
                             'transfer_exposed_s': 0.01, 'recompute_s': 0.0,
                             'plan_wait_s': 0.0, 'recompute_plan_s': 0.0})


def test_renderer_on_a_hand_made_result():
  rows = [_hand_row(1, 2.2, 2.0), _hand_row(2, 1.9, 2.0, {'eplb_step': 'X'})]
  summ = sweep_moves.summarize(rows)
  summ.update(target_ratio=1.05, plots=['results/sweep_moves/p.png'],
              assumptions=dict(profile={'name': 'h100'}, dispatch='exact',
                               num_microsteps=8, trace='synthetic'))
  text = render_results.render_sweep_moves({'summary': summ, 'rows': rows})
  lines = text.splitlines()
  assert lines[0].startswith('| model | devices | redundant slots / device')
  cells = [c.strip() for c in lines[2].strip('|').split('|')]
  assert cells[:10] == ['m', '8', '1', '1 x 64', '3.00', '2.50', '2.20',
                        '2.00', '**1.1000**', '**1.0909**']
  assert cells[10:] == ['1.250 -> 1.070', '-0.200 / +0.050 / +0.010',
                        '0.25', '0.125', '1.50', '0.04']
  cells = [c.strip() for c in lines[3].strip('|').split('|')]
  assert cells[8] == '0.9500'  # Not bold: the moves lose here.
  assert 'in 1 of 2 cells' in text and '**1.1000x** (`m/8dev/r1/1x64`)' in text
  assert 'worst 0.9500x (`m/8dev/r2/1x64`)' in text
  assert '1.05x reached in some cell: yes' in text
  # recompute_plan_s equal (measured once, charged to both): no noise.
  assert 'measured once and charged to both' in text
  assert '`m/8dev/r2/1x64` eplb_step: X' in text
  assert '[p.png](results/sweep_moves/p.png)' in text
  summ['step_timing_noise_max'] = 0.003  # A file from separate timings.
  text = render_results.render_sweep_moves({'summary': summ, 'rows': rows})
  assert 'differ by up to 0.30% of the step' in text
  assert 'measured once' not in text
