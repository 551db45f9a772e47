"""TensorBoard events: every number of a record comes back from the files."""
import threading

import numpy as np
import pytest

from foremoe_jax.utils import tensorboard


def test_records_round_trip_through_the_event_files(tmp_path):
  w = tensorboard.TensorBoardWriter(str(tmp_path))
  rng = np.random.default_rng(0)
  sent = []
  for step in (1, 2, 3):
    load_MD = rng.integers(1, 100, (2, 4)).astype(float)
    record = {'phase': 'rl', 'reward_mean': 0.1 * step, 'dropped': step,
              'planner': 'foremoe', 'ok': True,
              'microstep_max_over_mean': [1.0 + step, 2.0 + step],
              'device_load_MD': load_MD.tolist()}
    w.write(step, record)
    sent.append((step, record, load_MD))
  w.close()
  got = tensorboard.read_scalars(str(tmp_path / 'tensorboard'))
  for step, record, load_MD in sent:
    at = lambda tag: dict(got[tag])[step]
    assert at('rl/reward_mean') == pytest.approx(record['reward_mean'])
    assert at('rl/dropped') == step
    assert at('rl/microstep_max_over_mean/1') == pytest.approx(2.0 + step)
    for m in range(2):
      assert at(f'rl/device_load_max_over_mean/microstep_{m}') == \
          pytest.approx(load_MD[m].max() / load_MD[m].mean(), rel=1e-6)
  # Strings and bools are not scalars.
  assert not any(t.endswith(('planner', 'ok')) for t in got)


def test_a_resumed_writer_hides_the_steps_it_logs_again(tmp_path):
  """A crashed attempt logged steps 1-5; the rerun resumes at 3 (its
  checkpoint) with purge_step=3: each step reads back once, 3-6 from the
  rerun, as TensorBoard shows them."""
  first = tensorboard.TensorBoardWriter(str(tmp_path), 'tb/rl')
  for step in range(1, 6):
    first.write(step, {'phase': 'rl', 'loss': float(step)})
  # No close: a crash leaves the file as written (each write is flushed).
  rerun = tensorboard.TensorBoardWriter(str(tmp_path), 'tb/rl', purge_step=3)
  for step in range(3, 7):
    rerun.write(step, {'phase': 'rl', 'loss': 10.0 * step})
  rerun.close()
  got = tensorboard.read_scalars(str(tmp_path / 'tb' / 'rl'))
  assert got['rl/loss'] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0),
                            (5, 50.0), (6, 60.0)]
  first.close()


def test_each_step_is_on_disk_when_write_returns(tmp_path):
  """What a crash right after `write` leaves: every step written so far,
  read back from the file before the writer is closed (the trainer's
  resume relies on it: a step its checkpoint holds is not logged again).
  Every kind of event the writer makes, a histogram and an image among
  them, goes through the same path: the caller's thread, no other (a
  writer thread's queue was where a step could wait, unwritten, after
  its flush)."""
  threads = threading.active_count()
  w = tensorboard.TensorBoardWriter(str(tmp_path), 'tb/rl')
  logdir = str(tmp_path / 'tb' / 'rl')
  for step in range(1, 21):
    w.write(step, {'phase': 'rl', 'loss': float(step),
                   'device_load_MD': [[1.0, 3.0], [2.0, 2.0]],
                   'expert_tokens_LE': [[1, 2, 3, 4], [4, 3, 2, 1]]})
    got = tensorboard.read_scalars(logdir)
    assert got['rl/loss'] == [(s, float(s)) for s in range(1, step + 1)]
    assert got['rl/device_load_max_over_mean/microstep_0'][-1] == (step, 1.5)
  assert threading.active_count() == threads
  w.close()
