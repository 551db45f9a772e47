"""Checkpointer: what goes in comes back, and damage falls back, loudly."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from foremoe_jax.rl import checkpoint


def _tree(scale):
  return {'w': jnp.arange(6.0).reshape(2, 3) * scale,
          'b': jnp.full((3,), scale, jnp.float32)}


def _truncate_item(directory, step, item):
  for dirpath, _, files in os.walk(os.path.join(directory, str(step), item)):
    for f in files:
      open(os.path.join(dirpath, f), 'wb').close()


def test_round_trip_of_every_item_and_the_host_record(tmp_path):
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  host = {'numpy_rng': np.random.default_rng(3).bit_generator.state,
          'jax_key': {'impl': 'threefry2x32', 'data': [1, 2]}}
  ckpt.save(0, _tree(1.0), phase='warmstart_done', host={'a': 1})
  ckpt.save(5, _tree(2.0), phase='rl', opt_state=_tree(3.0),
            ref_params=_tree(4.0), host=host)
  r = ckpt.restore_latest(_tree(0.0), opt_state=_tree(0.0),
                          ref_params=_tree(0.0))
  assert (r['phase'], r['step']) == ('rl', 5)
  assert r['host'] == host  # 128-bit PCG64 integers survive JSON.
  for item, scale in (('params', 2.0), ('opt_state', 3.0),
                      ('ref_params', 4.0)):
    jax.tree.map(np.testing.assert_array_equal, r[item], _tree(scale))
  # The warm-start checkpoint holds params only: no other item comes back.
  w = ckpt.restore(0, {'params': _tree(0.0), 'opt_state': _tree(0.0)})
  assert set(w) == {'phase', 'step', 'host', 'params'}
  assert w['host'] == {'a': 1}


def test_unreadable_latest_falls_back_and_is_set_aside(tmp_path):
  d = str(tmp_path / 'checkpoints')
  ckpt = checkpoint.Checkpointer(d, max_to_keep=3)
  for step in (1, 2, 3):
    ckpt.save(step, _tree(float(step)), phase='rl', host={'step': step})
  _truncate_item(d, 3, 'params')
  lines = []
  r = checkpoint.Checkpointer(d).restore_latest(_tree(0.0), log=lines.append)
  assert r['step'] == 2
  jax.tree.map(np.testing.assert_array_equal, r['params'], _tree(2.0))
  assert lines[0].startswith(f'checkpoint at step 3 in {d} is unreadable (')
  assert lines[0].endswith('falling back to step 2')
  assert lines[1].startswith('moved the unreadable step 3 to ')
  assert sorted(os.listdir(d)) == ['1', '2']
  assert [n.split('.')[0] for n in os.listdir(d + '.unreadable')] == ['3']
  # The fallen-back run can save step 3 again.
  again = checkpoint.Checkpointer(d)
  again.save(3, _tree(9.0), phase='rl')
  assert again.restore_latest(_tree(0.0))['step'] == 3


def test_no_readable_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
  d = str(tmp_path)
  ckpt = checkpoint.Checkpointer(d)
  ckpt.save(1, _tree(1.0), phase='rl')
  _truncate_item(d, 1, 'params')
  with pytest.raises(RuntimeError, match='no checkpoint in .* restores'):
    checkpoint.Checkpointer(d).restore_latest(_tree(0.0), log=lambda _: None)


def test_empty_directory_restores_nothing(tmp_path):
  assert checkpoint.Checkpointer(str(tmp_path)).restore_latest(
      _tree(0.0)) is None


def test_set_aside_waits_for_process_0_before_listing_again(tmp_path,
                                                            monkeypatch):
  """In a multi-process run process 0 moves the unreadable steps; every
  process reloads the directory only after the barrier that follows the
  move (else it would still list them)."""
  d = str(tmp_path)
  ckpt = checkpoint.Checkpointer(d, max_to_keep=3)
  for step in (1, 2):
    ckpt.save(step, _tree(float(step)), phase='rl')
  _truncate_item(d, 2, 'params')
  events = []
  resumed = checkpoint.Checkpointer(d)
  reload = resumed._mgr.reload  # pylint: disable=protected-access
  monkeypatch.setattr(resumed._mgr, 'reload',  # pylint: disable=protected-access
                      lambda: (events.append('reload'), reload())[1])
  monkeypatch.setattr(checkpoint.distributed, 'max_over_processes',
                      lambda x: (events.append('barrier'), x)[1])
  real_replace = os.replace
  monkeypatch.setattr(checkpoint.os, 'replace', lambda a, b: (
      events.append('move'), real_replace(a, b))[1])
  assert resumed.restore_latest(_tree(0.0), log=lambda _: None)['step'] == 1
  assert events == ['move', 'barrier', 'reload']
