"""The grouped-GEMM bench: its load, its float32 reference, its check."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from foremoe_jax.benchmarks import grouped_gemm as gg

SMALL = gg.GroupedGemmBench(**{**gg.CPU, 'rows': 256, 'live_rows': 150,
                               'slots': 4, 'model_dim': 16, 'hidden_dim': 8,
                               'tile': 8, 'repeats': 1})


def test_inputs_spread_the_live_rows_over_slots_by_zipf():
  x, label, wg, wu, wd, ct = gg.inputs(SMALL)
  label = np.asarray(label)
  counts = np.bincount(label[label >= 0], minlength=SMALL.slots)
  assert counts.sum() == SMALL.live_rows and (label == -1).sum() == 106
  # Zipf with alpha 1 over 4 slots: 1 : 1/2 : 1/3 : 1/4, shuffled.
  assert sorted(counts, reverse=True)[0] == pytest.approx(
      150 / (1 + 1 / 2 + 1 / 3 + 1 / 4), abs=4)
  assert not np.asarray(ct)[label < 0].any()
  assert x.shape == (256, 16) and wg.shape == wu.shape == (4, 16, 8)
  assert wd.shape == (4, 8, 16)
  with pytest.raises(ValueError, match='live_rows'):
    gg.inputs(dataclasses.replace(SMALL, live_rows=300))


def test_reference_step_is_each_row_through_its_slot_in_numpy():
  x, label, wg, wu, wd, ct = gg.inputs(SMALL)
  y, (dx, dwg, dwu, dwd) = gg.reference_step(x, label, wg, wu, wd, ct, 4,
                                             80)
  xn, ln, ctn = (np.asarray(x, np.float64), np.asarray(label),
                 np.asarray(ct, np.float64))
  wgn, wun, wdn = (np.asarray(w, np.float64) for w in (wg, wu, wd))
  sig = lambda a: 1 / (1 + np.exp(-a))
  want = {k: np.zeros_like(v) for k, v in
          dict(y=xn, dx=xn, dwg=wgn, dwu=wun, dwd=wdn).items()}
  for r in np.nonzero(ln >= 0)[0]:
    s = ln[r]
    a, b = xn[r] @ wgn[s], xn[r] @ wun[s]
    h = a * sig(a) * b
    want['y'][r] = h @ wdn[s]
    dh = ctn[r] @ wdn[s].T
    da = dh * b * (sig(a) * (1 + a * (1 - sig(a))))
    db = dh * a * sig(a)
    want['dx'][r] = da @ wgn[s].T + db @ wun[s].T
    want['dwg'][s] += np.outer(xn[r], da)
    want['dwu'][s] += np.outer(xn[r], db)
    want['dwd'][s] += np.outer(h, ctn[r])
  got = dict(y=y, dx=dx, dwg=dwg, dwu=dwu, dwd=dwd)
  for k in got:
    np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-4,
                               atol=1e-4, err_msg=k)


def test_run_checks_every_kind_then_times_those_that_pass():
  out = gg.run(SMALL, log=lambda *a: None)
  assert out['complete'], out['errors']
  assert set(out['check']) == set(SMALL.kinds)
  assert max(out['check'].values()) < 1e-4
  assert set(out['seconds']) == {'batched', *SMALL.kinds}
  assert out['pallas_speedup_vs_ragged_dot'] > 0


def test_a_kind_over_tolerance_is_not_timed():
  # A tolerance below float32 rounding fails every kind's check: none is
  # timed, and the run says why.
  cfg = dataclasses.replace(SMALL, tolerance=0.0, kinds=('ragged_dot',))
  out = gg.run(cfg, log=lambda *a: None)
  assert not out['complete']
  assert 'over tolerance' in out['errors']['ragged_dot']
  assert set(out['seconds']) == {'batched'}


def test_a_past_deadline_measures_nothing():
  out = gg.run(SMALL, log=lambda *a: None, deadline=0.0)
  assert out['skipped'] == 'deadline' and not out['complete']
  with pytest.raises(ValueError, match='kinds'):
    gg.run(dataclasses.replace(SMALL, kinds=('cublas',)))
