"""Layers planned apart (planner.layers): the same plan as all at once, and a
late or failing chunk costs only its own layers."""
import concurrent.futures
import dataclasses
import threading

import numpy as np
import pytest

from foremoe_jax.planner import foremoe, guard
from foremoe_jax.planner import layers as layers_lib
from foremoe_jax.planner.topology import Topology

import planner_testlib as lib

_FIELDS = ('loads_MLD', 'slot_loads_MLS', 'max_cell_ML', 'moves_MLD',
           'bytes_moved_M')


def assert_same_plan(got, want):
  np.testing.assert_array_equal(got.placement.slot_expert,
                                want.placement.slot_expert)
  np.testing.assert_array_equal(got.placement.slot_share,
                                want.placement.slot_share)
  for f in _FIELDS:
    np.testing.assert_array_equal(getattr(got, f), getattr(want, f), err_msg=f)


def skewed():
  """16 devices on 2 nodes, layers whose hot-device counts differ (the
  case where ForeMoE's moves once depended on the other layers)."""
  trace = lib.small_trace(num_experts=64, num_devices=16, num_layers=6,
                          seed=0, hot_share_range=(0.03, 0.15))
  return trace, Topology(2, 8, 64 // 16 + 1)


def test_chunks_cover_the_layers_once_evenly():
  for num_layers, n in ((7, 3), (4, 8), (1, 1), (48, 16)):
    cs = layers_lib.chunks(num_layers, n)
    assert np.concatenate(cs).tolist() == list(range(num_layers))
    sizes = [len(c) for c in cs]
    assert len(cs) == min(n, num_layers) and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize('fn', (guard.run_method, guard.step_level))
@pytest.mark.parametrize('method', guard.METHODS)
def test_a_step_planned_by_chunks_is_the_step_planned_whole(method, fn):
  """Every method's plan (and step-level plan) of a chunk of layers is the
  whole step's plan of those layers, exactly; joined back, the step's."""
  trace, topo = skewed()
  current = lib.identity_for(trace, topo)
  loads = trace.step(1)
  history = loads.sum(axis=(0, 2)).astype(float)[::-1].copy()  # EPLB's.
  config = foremoe.ForeMoEConfig(home_anchor=method != 'foremoe',
                                 anchor_rounds=16, moves_per_layer=2)
  if fn is guard.run_method:  # The micro-step plan takes a deadline.
    fn = lambda *args, run=fn: run(*args, None)
  whole = fn(method, topo, lib.COST, config, loads, current, history)
  parts = []
  for ls in layers_lib.chunks(loads.shape[1], 4):
    part = fn(method, topo, lib.COST, config, loads[:, ls],
              layers_lib.take_placement(current, ls, axis=0), history[ls])
    assert_same_plan(part, layers_lib.take(whole, ls,
                                           lib.COST.bytes_per_expert))
    parts.append((ls, part))
  joined = layers_lib.join(parts[::-1], loads.shape[1])
  assert_same_plan(joined, whole)
  if whole.from_split_L is not None:
    np.testing.assert_array_equal(joined.from_split_L, whole.from_split_L)
  lib.check_plan(joined, loads, topo)


def test_join_refuses_parts_that_miss_or_repeat_a_layer():
  trace, topo = lib.one_node()
  plan = guard.run_method('static', topo, lib.COST, foremoe.ForeMoEConfig(),
                          trace.step(0), lib.identity_for(trace, topo), None,
                          None)
  take = lambda ls: (np.asarray(ls), layers_lib.take(plan, ls, 1.0))
  with pytest.raises(ValueError, match='each of 0..2 once'):
    layers_lib.join([take([0]), take([0, 1])], 3)
  with pytest.raises(ValueError, match='each of 0..2 once'):
    layers_lib.join([take([0, 1])], 3)


def test_worker_processes_plan_what_one_thread_plans():
  """Two real worker processes: the plan and the step-level plan equal the
  single-thread planner's, step after step (the current placement carried
  over)."""
  trace, topo = skewed()
  first = lib.identity_for(trace, topo)
  one = guard.StepPlanner('foremoe', topo, lib.COST, first, deadline_s=120.0)
  two = guard.StepPlanner('foremoe', topo, lib.COST, first, deadline_s=120.0,
                          workers=2)
  try:
    for r in range(2):
      assert_same_plan(two.step_level_plan(trace.step(r)),
                       one.step_level_plan(trace.step(r)))
      ticket = two.submit(trace.step(r))
      got, want = ticket.result(), one.plan(trace.step(r))
      assert ticket.fallback_reason is None and got.layers_fell_back == 0
      assert_same_plan(got, want)
      np.testing.assert_array_equal(two.current.slot_expert,
                                    one.current.slot_expert)
    assert two.stats()['workers'] == 2
  finally:
    one.close()
    two.close()


class ThreadLayers:
  """LayerPool's interface on threads, so a test can hold or break chunks
  (monkeypatching does not reach a worker process)."""

  def __init__(self, hold=(), fail=()):
    self.calls, self.restarts = 0, 0
    self.hold, self.fail = set(hold), set(fail)
    self.release = threading.Event()
    self._pool = concurrent.futures.ThreadPoolExecutor(4)

  def submit(self, fn, *args):
    i = self.calls
    self.calls += 1

    def run():
      if i in self.hold:
        self.release.wait(10.0)
      if i in self.fail:
        raise RuntimeError('chunk bug')
      return fn(*args)
    return self._pool.submit(run)

  def restart(self):
    self.restarts += 1

  def close(self):
    self.release.set()
    self._pool.shutdown(wait=False)


@pytest.mark.parametrize('broken', ('late', 'failed'))
def test_a_late_or_failed_chunk_costs_only_its_layers(broken):
  """Chunk 1 of 3 hangs past the deadline (or raises): its layers take the
  fallback plan's, the others keep their own plan; the reason and the
  counters say so; the next step gets fresh workers and a whole plan."""
  trace = lib.small_trace(num_layers=6, seed=1)
  topo = Topology(1, 8, 32 // 8 + 2)
  first = lib.identity_for(trace, topo)
  loads = trace.step(1)
  whole = guard.StepPlanner('foremoe', topo, lib.COST, first,
                            carry_over=False).plan(loads)
  planner = guard.StepPlanner('foremoe', topo, lib.COST, first,
                              deadline_s=30.0, carry_over=False, workers=3,
                              chunks_per_worker=1)
  pool = ThreadLayers()
  planner._layers.close()  # pylint: disable=protected-access
  planner._layers = pool  # pylint: disable=protected-access
  fallback = planner.step_level_plan(loads)
  pool.calls = 0
  pool.hold, pool.fail = {1} if broken == 'late' else set(), (
      {1} if broken == 'failed' else set())
  ticket = planner.submit(loads, deadline_s=1.0 if broken == 'late' else 30.0,
                          fallback=fallback)
  plan = ticket.result()
  late = np.zeros(6, bool)
  late[layers_lib.chunks(6, 3)[1]] = True
  np.testing.assert_array_equal(plan.fell_back_L, late)
  assert plan.layers_fell_back == 2 and not plan.fell_back
  ok, bad = np.flatnonzero(~late), np.flatnonzero(late)
  bpe = lib.COST.bytes_per_expert
  strip = lambda p: p._replace(bytes_moved_M=np.zeros(1))
  assert_same_plan(strip(layers_lib.take(plan, ok, bpe)),
                   strip(layers_lib.take(whole, ok, bpe)))
  assert_same_plan(strip(layers_lib.take(plan, bad, bpe)),
                   strip(layers_lib.take(fallback, bad, bpe)))
  lib.check_plan(plan, loads, topo)
  why = ('deadline 1000 ms missed' if broken == 'late'
         else 'planner failed (RuntimeError: chunk bug)')
  assert ticket.fallback_reason == (
      f'{why} in 1 of 3 layer chunks -> given plan for 2 of 6 layers')
  stats = planner.stats()
  assert stats['fallbacks'] == 0 and stats['layer_fallbacks'] == 1
  assert stats['layers_fallen_back'] == 2
  assert stats['timeouts' if broken == 'late' else 'failures'] == 1
  # The next step: the held chunk still runs, so new workers; all its own.
  pool.hold, pool.fail = set(), set()
  ticket = planner.submit(loads, deadline_s=30.0)
  assert pool.restarts == (1 if broken == 'late' else 0)
  again = ticket.result()
  assert ticket.fallback_reason is None and again.fell_back_L is None
  assert_same_plan(again, whole)
  planner.close()


def test_without_a_plan_handed_over_late_layers_get_their_step_level_plan():
  trace = lib.small_trace(num_layers=4, seed=2)
  topo = Topology(1, 8, 32 // 8 + 2)
  first = lib.identity_for(trace, topo)
  loads = trace.step(1)
  planner = guard.StepPlanner('foresight_split', topo, lib.COST, first,
                              deadline_s=30.0, workers=2, chunks_per_worker=1)
  want = planner.step_level_plan(loads)
  planner._layers.close()  # pylint: disable=protected-access
  planner._layers = ThreadLayers(fail=[0])  # pylint: disable=protected-access
  ticket = planner.submit(loads)
  plan = ticket.result()
  bad = layers_lib.chunks(4, 2)[0]
  assert ticket.fallback_reason.endswith(
      '-> step-level plan for 2 of 4 layers')
  bpe = lib.COST.bytes_per_expert
  assert_same_plan(layers_lib.take(plan, bad, bpe),
                   layers_lib.take(want, bad, bpe))
  lib.check_plan(plan, loads, topo)
  planner.close()


def test_default_workers_leave_small_hosts_to_one_thread(monkeypatch):
  monkeypatch.setattr(guard.os, 'cpu_count', lambda: 2)
  assert guard.default_workers() == 1
  monkeypatch.setattr(guard.os, 'cpu_count', lambda: 64)
  assert guard.default_workers() == 8 and guard.default_workers(5) == 5
  monkeypatch.setattr(guard.os, 'cpu_count', lambda: 12)
  assert guard.default_workers() == 3
  with pytest.raises(ValueError, match='workers'):
    guard.StepPlanner('static', Topology(1, 8, 5), lib.COST,
                      lib.identity_for(lib.small_trace(), Topology(1, 8, 5)),
                      workers=0)


def test_workers_never_run_the_parents_main_script(tmp_path):
  """A script without an `if __name__ == '__main__'` guard that plans with
  worker processes runs its top level once: the workers start under a
  bare __main__ instead of re-importing the script (as multiprocessing's
  spawn and forkserver otherwise do)."""
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  script = tmp_path / 'unguarded.py'
  script.write_text(
      "print('top level ran', flush=True)\n"
      'from foremoe_jax.planner import layers\n'
      'pool = layers.LayerPool(2)\n'
      'print(pool.submit(sum, [1, 2, 3]).result(), flush=True)\n'
      'pool.close()\n')
  root = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  out = subprocess.run([sys.executable, str(script)], capture_output=True,
                       text=True, timeout=120, check=True,
                       env={**os.environ, 'PYTHONPATH': root})
  assert out.stdout.split('\n')[:3] == ['top level ran', '6', ''], out


def test_a_thread_pool_plans_the_same_and_bad_pools_are_refused():
  trace, topo = skewed()
  first = lib.identity_for(trace, topo)
  pool = layers_lib.LayerPool(2, kind='thread')
  one = guard.StepPlanner('foremoe', topo, lib.COST, first)
  two = guard.StepPlanner('foremoe', topo, lib.COST, first, layer_pool=pool)
  assert two.workers == 2
  assert_same_plan(two.plan(trace.step(1)), one.plan(trace.step(1)))
  two.close()  # A pool handed over stays open for its owner.
  assert_same_plan(two.step_level_plan(trace.step(1)),
                   one.step_level_plan(trace.step(1)))
  pool.close()
  one.close()
  with pytest.raises(ValueError, match='at least 2 workers'):
    layers_lib.LayerPool(1)
  with pytest.raises(ValueError, match='kind'):
    layers_lib.LayerPool(2, kind='gpu')


@pytest.mark.parametrize('method', guard.METHODS)
def test_step_level_plan_in_threads_is_the_plan_in_one(method):
  """assemble_plan's micro-steps split in threads: the same plan, exactly."""
  trace, topo = skewed()
  current = lib.identity_for(trace, topo)
  loads = trace.step(1)
  history = loads.sum(axis=(0, 2)).astype(float)[::-1].copy()
  config = foremoe.ForeMoEConfig(anchor_rounds=16, moves_per_layer=2)
  one = guard.step_level(method, topo, lib.COST, config, loads, current,
                         history)
  assert_same_plan(guard.step_level(method, topo, lib.COST, config, loads,
                                    current, history, threads=3), one)


@pytest.mark.parametrize('machine', ['one_node', 'two_nodes'])
def test_step_level_plan_holds_foresight_splits_placement(machine):
  """The recompute runs on the step-level plan while the update's plan is
  made; for the foresight methods it holds the placement foresight_split
  holds for the whole step (the anchor, refined on the step's totals), so
  a forward is balanced as the foresight_split update is."""
  trace, topo = getattr(lib, machine)()
  current = lib.identity_for(trace, topo)
  config = foremoe.ForeMoEConfig(home_anchor=True, anchor_rounds=8,
                                 microstep_degree=2)
  for r in range(1, trace.num_steps):
    loads = trace.step(r)
    held = foremoe.plan_step(loads, topo, lib.COST, current,
                             dataclasses.replace(config, max_rounds=0))
    got = guard.step_level('foremoe', topo, lib.COST, config, loads, current,
                           None)
    np.testing.assert_array_equal(got.placement.slot_expert,
                                  held.placement.slot_expert)
