"""Rebuilds the generated results blocks from results/<bench>.json.

  python -m experiments.render_results           # rewrite the files in place
  python -m experiments.render_results --check   # exit 1 if one is stale

README.md (the front door: the demo's numbers and a headline table) and
docs/results.md (every benchmark's full tables) hold generated blocks
between
  <!-- results:<name> -->  and  <!-- /results:<name> -->
where <name> is a benchmark (`<bench>.<part>` renders one part of a file,
where its section holds text between the parts) or a block drawn from
several files (`headline`). Each benchmark block is the command that
produced the file, the machine and versions it ran on, and the table(s)
made from its result, so the numbers in the docs are always those of a run
the repository can regenerate (run the benchmark, then this). Text outside
the markers is left alone. A test (tests/test_render_results.py) runs the
check.
"""
from __future__ import annotations

import collections
import difflib
import json
import os
import re
import sys

from absl import app, flags
import numpy as np

from foremoe_jax.utils import results

# The files with generated blocks, relative to the repository root.
DEFAULT_FILES = ('README.md', 'docs/results.md')

_FILES = flags.DEFINE_list('files', list(DEFAULT_FILES),
                           'The files whose blocks to rewrite.')
_RESULTS_DIR = flags.DEFINE_string('results_dir', results.DEFAULT_DIR,
                                   'Where the <bench>.json files are.')
_CHECK = flags.DEFINE_bool('check', False, 'Do not write; exit 1 and print '
                           'a diff if a file does not match the results.')

BLOCK_RE = re.compile(
    r'(<!-- results:(?P<bench>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /results:(?P=bench) -->)',
    re.S)


# ---------------------------------------------------------------- formatting

def _f(x, digits: int = 3) -> str:
  """`digits` significant figures, trailing zeros kept (1.00, not 1); never
  an exponent above 1; integers whole with thousands separators."""
  if x is None:
    return '-'
  if isinstance(x, bool):
    return 'yes' if x else 'no'
  if isinstance(x, int):
    return f'{x:,}'
  if x == 0:
    return '0'
  if abs(x) >= 1:
    whole = len(str(int(abs(x))))
    if whole >= digits:
      return f'{round(x):,}'
    return f'{x:.{digits - whole}f}'
  if round(abs(x), digits - 1) >= 1:  # 0.9999 reads 1.00, not 1.
    return f'{x:.{digits - 1}f}'
  return f'{x:.{digits}g}'


def _met(over_target: float) -> str:
  return 'met' if over_target >= 1 else '**missed**'


def _bytes(x: float) -> str:
  for unit, scale in (('GB', 1e9), ('MB', 1e6), ('kB', 1e3)):
    if x >= scale:
      return f'{x / scale:.3g} {unit}'
  return f'{x:.0f} B'


def _table(header: list[str], rows: list[list[str]]) -> str:
  lines = ['| ' + ' | '.join(header) + ' |',
           '|' + '---|' * len(header)]
  lines += ['| ' + ' | '.join(r) + ' |' for r in rows]
  return '\n'.join(lines)


def provenance(record: dict) -> str:
  """Command, machine and versions of one results file, as one line."""
  run = record['run']
  machine = f"{run.get('cpu_count', '?')}-core host"
  if 'backend' in run:
    machine += (f", {run['devices']} {run['backend']} device(s)"
                f" ({run.get('device_kind', '?')})")
  versions = ', '.join(f'{k} {run[k]}' for k in ('python', 'jax', 'flax',
                                                 'numpy', 'triton')
                       if k in run)
  if run.get('xla_flags'):
    versions += f" · XLA_FLAGS={run['xla_flags']}"
  return (f"`{record['command']}` · {machine} · {versions} · "
          f"file `results/{record['bench']}.json`")


# ------------------------------------------------------------ per benchmark

_METHOD_NAMES = {'static': 'static EP', 'eplb_step': 'EPLB, step-level',
                 'eplb_microstep': 'EPLB per micro-step',
                 'foresight_split': 'foresight split (no moves)',
                 'foremoe': 'ForeMoE'}


def _per_repetition(res) -> list[str]:
  """The step's ratios within each repetition (its methods ran back to
  back), lowest to highest: the host's noise around the medians' ratio."""
  reps = res.get('speedup_step_per_repetition')
  if not reps:
    return []
  span = lambda b: f"{_f(min(reps[b]))}-{_f(max(reps[b]))}x"
  return [f"- Within each of the {len(reps['static'])} repetitions (the"
          f" methods back to back), whole step: {span('static')} vs static"
          f" EP, {span('eplb_step')} vs step-level EPLB,"
          f" {span('foresight_split')} vs foresight split."]


def _step_level_plan(res: dict) -> str:
  """The demo's step-level plan, made before the recompute (every step
  waits for it); older records lack it."""
  t = res.get('recompute_plan_s_median')
  return '' if t is None else (f'; the step-level plan {_f(1e3 * t)} ms,'
                               ' made before the recompute starts (on every'
                               " step's critical path)")


def render_rl_step(res: dict) -> str:
  rows = []
  for m, name in _METHOD_NAMES.items():
    r = res['methods'][m]
    rows.append([
        name, _f(r['step_s']), _f(r['update_s']), _f(r['recompute_s']),
        f"{_f(r['microstep_max_over_mean_mean'], 4)} "
        f"({_f(r['microstep_max_over_mean_p95'], 4)})",
        f"{_f(r['capacity'])} ({_f(r['recompute_capacity'])})",
        _bytes(r['weight_bytes_moved_per_device_per_microstep']),
        _f(r['exposed_transfer_s'], 2),
        _f(r.get('recompute_plan_s'), 2),
        f"{_f(r['plan_s'], 2)} ({_f(r['plan_wait_s'], 2)})",
        _f(r['reverted_moves'])])
  table = _table(['method', 'step s', 'update s', 'recompute s',
                  'micro-step max/mean (p95)', 'bucket (recompute)',
                  'weights moved / device / micro-step', 'exposed transfer s',
                  'step-level plan s', 'micro-step plan s (wait)',
                  'slot changes undone'], rows)
  fm = res['methods']['foremoe']
  compiles = res['step_compiles']
  return '\n'.join([
      table, '',
      f"- Whole step, ForeMoE vs static EP:"
      f" **{_f(res['speedup_step_vs_static'])}x**; vs step-level EPLB:"
      f" **{_f(res['speedup_step_vs_eplb_step'])}x**; vs foresight split"
      f" (same foresight, no moves): {_f(res['speedup_step_vs_foresight_split'])}x."
      f" Update alone: {_f(res['speedup_update_vs_static'])}x,"
      f" {_f(res['speedup_update_vs_eplb_step'])}x and"
      f" {_f(res['speedup_update_vs_foresight_split'])}x.",
      *_per_repetition(res),
      f"- Shape: {_f(res['microsteps'])} micro-steps of"
      f" {_f(res['sequences_per_microstep'])} sequences,"
      f" {_f(res['tokens_per_microstep'])} tokens per micro-step"
      f" ({_f(res['tokens_per_microstep'] // res['devices'])} per device).",
      f"- Dispatch: {res['dispatch']}-count, buckets"
      f" {res['capacity_buckets']}. Recompute forward passes:"
      f" {_f(res['recompute_forward_passes'])}. Compiles over the whole run"
      f" (every method and bucket): update {_f(compiles['update'])},"
      f" recompute {_f(compiles['recompute'])}.",
      f"- Parameters after the ForeMoE step vs the static step: max relative"
      f" difference {_f(res['max_rel_param_diff'], 2)}. Expert all-gather in"
      f" the compiled update: {_f(fm['hlo_expert_all_gather_bytes'])} bytes;"
      f" slots holding the wrong expert: {_f(fm['transfer_id_errors'])};"
      f" dropped tokens: {_f(fm['dropped'])}; plan wait"
      f" {_f(100 * res['plan_wait_frac_of_step'], 2)}% of the step.",
  ] + ([
      f"- Transfers: experts on the wire over experts that had to move,"
      f" ForeMoE: {_f(fm['wire_bytes_over_useful'], 3)} for the collective a"
      f" GPU/TPU runs (one ragged all-to-all per layer and transition);"
      f" {_f(fm['wire_bytes_over_useful_cpu_emulation'], 3)} for the CPU"
      f" emulation this run used (shift rounds, every device sending in each)."]
       if 'wire_bytes_over_useful' in fm else []))


def render_moe_layer(res: dict) -> str:
  rows = []
  for d, sfx in (('exact', ''), ('padded', '_padded')):
    rows.append([f'static ({d})', _f(res['static_max_over_mean'], 4),
                 f"{_f(res[f'static_demand{sfx}'])} / "
                 f"{_f(res[f'static_capacity{sfx}'])}",
                 _f(res[f'static_s{sfx}']), '-', '-'])
    rows.append([f'balanced, ForeMoE placement ({d})',
                 _f(res['balanced_max_over_mean'], 4),
                 f"{_f(res[f'balanced_demand{sfx}'])} / "
                 f"{_f(res[f'balanced_capacity{sfx}'])}",
                 _f(res[f'balanced_s{sfx}']),
                 f"{_f(res[f'speedup{sfx}'])}"
                 + (f" (target {_f(res['target_speedup'])})" if not sfx
                    else ''),
                 _f(res[f'speedup_with_moves{sfx}'])])
  table = _table(['placement (dispatch)', 'max/mean',
                  'rows to hold / bucket', 'forward s', 'speedup vs static',
                  'speedup with a full slot fill'], rows)
  return '\n'.join([
      table, '',
      "- Rows to hold: a device's received rows (exact) or the largest"
      " (source, destination) cell (padded).",
      f"- Slot fill by the engine: {_f(res['transfer_rounds'])} ppermute"
      f" rounds, {_bytes(res['move_bytes_per_device'])} per device in"
      f" {_f(res['transfer_s'])} s, vs an all-gather of"
      f" {_bytes(res['allgather_bytes_per_device'])} per device in"
      f" {_f(res['allgather_transfer_s'])} s.",
      f"- Max error vs the loop-over-experts reference"
      f" {_f(res['max_abs_err_vs_reference'], 2)}; {res['compiles']} compiles"
      f" (one per dispatch and bucket).",
  ])


def render_planner(res: dict) -> str:
  rows, budgets = [], set()
  for c in res['configs']:
    mm = {m: r['mean_max_over_mean'] for m, r in c['methods'].items()}
    fm, micro = c['methods']['foremoe'], c['methods']['eplb_microstep']
    con = c['methods'].get('foremoe_constrained')
    trace = c['trace'] + (f" (x{c['load_scale']})"
                          if c.get('load_scale', 1) != 1 else '')
    if con is None:
      trained = ['-', '-']
    else:
      b = c['transfer_budget']
      budgets.add((c['devices'], b['step_rounds'], b['microstep_rounds']))
      trained = [
          f"{_f(con['mean_max_over_mean'], 4)}"
          f" ({c['constraint_cost']:+.4f})"
          f" {'met' if c['meets_target_constrained'] else '**missed**'}",
          f"{_f(con['copies_per_device_per_microstep_all_layers'], 2)};"
          f" {con['fit_reverted_slots_per_step']:.1f};"
          f" {con['fit_layers_sent_home_per_step']:.1f};"
          f" {_f(con['latency_ms_per_step'])}"]
    rows.append([
        c['name'], trace, _f(c['redundant_slots_per_device']),
        _f(mm['static'], 4), _f(mm['eplb_step'], 4),
        _f(mm['eplb_microstep'], 4), f"**{_f(mm['foremoe'], 4)}**",
        f"{_f(c['target_max_over_mean'])} {'met' if c['meets_target'] else '**missed**'}",
        f"{_f(fm['copies_per_device_per_microstep_all_layers'], 2)}"
        f" ({_f(micro['copies_per_device_per_microstep_all_layers'], 2)})",
        f"{_f(fm['latency_ms_per_step'])} ({_f(fm['latency_vs_eplb_microstep'], 2)}x)",
        *trained,
    ])
  table = _table(['config', 'trace', 'redundant slots / device', 'static',
                  'EPLB step', 'EPLB micro-step', 'ForeMoE', 'target',
                  'ForeMoE copies / device / micro-step, all layers'
                  ' (EPLB micro-step)',
                  'ForeMoE ms per step (vs EPLB micro-step)',
                  "ForeMoE in training (vs ForeMoE), target",
                  'in training: copies / device / micro-step; slots undone'
                  ' by the fit / step; layers sent home / step; ms per step'],
                 rows)
  gap = res.get('milp_gap')
  lines = [table, '',
           f"- Mean max/mean device load over scored micro-steps and layers."
           f" All ForeMoE targets met: {_f(res['all_targets_met'])}."]
  if 'all_targets_met_constrained' in res:
    rule = '; '.join(f'{s} fill / flush and {m} micro-step rounds on {d}'
                     f' devices' for d, s, m in sorted(budgets))
    lines.append(
        "- ForeMoE in training: as the trainer's StepPlanner calls it (home"
        " anchor, the transfer budget's rounds as anchor rounds and,"
        " between micro-steps, as each device's degree; its exact-byte"
        " transfers pricing the anchor's fills and flushes), from the home"
        " layout every step, then fitted to the"
        f" transfer budget ({rule}; the trainer's default is one fill /"
        " flush round per EP device and 2 micro-step rounds) with its move"
        " schedule built; ms include"
        " the fit and schedule, and no deadline applies. The targets are"
        " set on ForeMoE alone; all met in training too:"
        f" {_f(res['all_targets_met_constrained'])} (the budget costs"
        f" {res['constraint_cost_mean']:+.4f} max/mean on average, at most"
        f" {res['constraint_cost_max']:+.4f}).")
  if gap is not None:
    lines.append(f"- Optimality gap of ForeMoE to the exact MILP (small"
                 f" instances): {_f(100 * gap, 2)}%.")
  if res.get('alt_configs'):
    lines += ['', render_planner_alt(res)]
  return '\n'.join(lines)


def render_planner_alt(res: dict) -> str:
  """The planner on traces of another family (foresight/alt_traces.py):
  per shape and redundant slots, over its Zipf exponents and Dirichlet
  concentrations, how many rows meet the target and the mean / worst
  micro-step max/mean of each method."""
  groups = {}
  for c in res['alt_configs']:
    # alt_zipf{s}_c{c}_{shape}_r{n}: the shape is what the rows share.
    shape = '_'.join(c['name'].split('_')[3:-1])
    groups.setdefault((shape, c['redundant_slots_per_device']), []).append(c)
  mm = lambda c, m: c['methods'][m]['mean_max_over_mean']
  rows = []
  for (shape, r), cs in groups.items():
    con = [mm(c, 'foremoe_constrained') for c in cs]
    free = [mm(c, 'foremoe') for c in cs]
    rows.append([
        shape, _f(r), _f(cs[0]['target_max_over_mean']),
        f"{sum(c['meets_target_constrained'] for c in cs)} / {len(cs)}",
        f'{_f(float(np.mean(con)), 4)} ({_f(max(con), 4)})',
        f"{sum(c['meets_target'] for c in cs)} / {len(cs)}",
        f'{_f(float(np.mean(free)), 4)} ({_f(max(free), 4)})',
        _f(float(np.mean([mm(c, 'eplb_step') for c in cs])), 4),
        _f(float(np.mean([mm(c, 'eplb_microstep') for c in cs])), 4)])
  copies = lambda m: float(np.mean(
      [c['methods'][m]['copies_per_device_per_microstep_per_layer']
       for c in res['alt_configs']]))
  table = _table(['shape', 'redundant slots / device', 'target',
                  'ForeMoE in training: rows met', 'mean (worst)',
                  'ForeMoE alone: rows met', 'mean (worst)',
                  'EPLB step, mean', 'EPLB micro-step, mean'], rows)
  return '\n'.join([
      '**On traces of another family** (`foresight/alt_traces.py`: Zipf'
      ' popularity per layer, each sequence routed by a Dirichlet draw'
      ' around it; exponents 0.6 / 1.0 / 1.4 and concentrations 0.3 / 3 /'
      ' 30 per shape, 2,048 tokens per device per micro-step):', '', table,
      '', f"- All met: in training {_f(res['alt_all_targets_met_constrained'])},"
      f" ForeMoE alone {_f(res['alt_all_targets_met'])}. ForeMoE alone"
      " plans each step from the last one's placement with no round"
      " budget, so without the home anchor's shed of each micro-step's"
      " excess; the trainer, the simulator and bench_rl_step all plan"
      " as in training. Copies per device, layer and micro-step: in"
      f" training {_f(copies('foremoe_constrained'), 3)}, EPLB step"
      f" {_f(copies('eplb_step'), 3)}. EPLB per"
      ' micro-step re-packs every micro-step from its exact loads'
      f" ({_f(copies('eplb_microstep'), 3)} copies): a bound, not a"
      ' peer.'])


def render_msa(res: dict) -> str:
  per_repeat = lambda r: ' / '.join(
      _f(x) for x in r.get('speedup_vs_causal_dense_per_repeat', [])) or '-'
  rows = [[_f(r['seq_len']), _f(r['causal_dense_s']), _f(r['dense_s']),
           _f(r['msa_s']), f"**{_f(r['speedup_vs_causal_dense'])}**",
           per_repeat(r), _f(r['speedup']), _f(r['flop_ratio']),
           _f(r['index_fraction'], 2)]
          for r in res['results']]
  prefill = _table(['seq_len', 'flash-style causal dense s',
                    'masked-square dense s', 'MSA s',
                    'speedup vs causal dense', 'each repetition',
                    'speedup vs masked square', 'FLOP ratio',
                    'index share of MSA'], rows)
  lines = ['Prefill:', '', prefill, '',
           f"- Target at the longest length: speedup vs causal dense >= 0.7 x"
           f" FLOP ratio = {_f(res['target_speedup_vs_causal_dense_at_max_len'])}:"
           f" {_met(res['speedup_vs_causal_dense_over_target'])}"
           f" (measured / target = {_f(res['speedup_vs_causal_dense_over_target'])});"
           f" grows with length:"
           f" {_f(res['speedup_vs_causal_dense_grows_with_length'])}.",
           f"- Max error of the CPU path vs the reference at"
           f" {res['reference_check_len']} tokens:"
           f" {_f(res['max_abs_err_vs_reference'], 2)}. The FLOP formula at"
           f" the paper's shape (1M tokens, 16 heads per group) gives"
           f" {_f(res['paper_flop_ratio'])}."]
  if res.get('decode'):
    ms = lambda r, key: _f(1e3 * r[key]) if key in r else '-'
    rows = [[_f(r['cache_len']), _f(r['batch']), ms(r, 'dense_s'),
             ms(r, 'grouped_dense_s'), ms(r, 'rows_dense_s'), ms(r, 'msa_s'),
             f"**{_f(r['speedup'])}**", _f(r.get('speedup_vs_jax_nn')),
             _f(r['flop_ratio'])] for r in res['decode']]
    lines += ['', 'Decode (one new token per sequence, full [B, S, G, D]'
              ' caches; speedup against the fastest dense decode):', '',
              _table(['cache', 'batch', 'jax.nn dense ms',
                      'grouped-einsum dense ms', 'row-order dense ms',
                      'MSA ms', 'speedup',
                      'vs jax.nn', 'FLOP ratio'], rows), '',
              f"- Target at the longest cache: >= 0.5 x FLOP ratio ="
              f" {_f(res['decode_target_speedup_at_max_cache'])}:"
              f" {_met(res['decode_speedup_over_target'])} (measured /"
              f" target = {_f(res['decode_speedup_over_target'])}). The paper"
              f" reports {_f(res['paper_decode_speedup_at_1m'])}x decode at a"
              f" 1M cache, where this formula gives"
              f" {_f(res['paper_decode_flop_ratio_at_1m'])}."]
  return '\n'.join(lines)


def render_gpu_static(res: dict) -> str:
  """The MSA kernels compiled for sm_90a on this host (no GPU)."""
  rows = []
  for r in res['rows']:
    if 'error' in r:
      rows.append([r['site'], r.get('kernel', '-'), '-', '-', '-', '-',
                   f"error: {r['error'][:80]}", '-', '-'])
      continue
    occ, ops = r['occupancy'], r['opcodes']
    rows.append([
        r['site'], r['kernel'], f"{r['num_warps']} / {r['num_stages']}",
        f"{r['shared_bytes'] / 1024:.1f}", _f(r['registers']),
        _f(r['spill_store_bytes']),
        f"{occ['blocks_per_sm']} ({' + '.join(occ['limited_by'])})",
        f"{_f(ops['HGMMA'])} / {_f(ops.get('QGMMA', 0))}", _f(ops['HMMA'])])
  summ = res['summary']
  listed = lambda xs: ', '.join(f'`{x}`' for x in xs) or 'none'
  return '\n'.join([
      _table(['site', 'kernel', 'warps / stages', 'shared KiB', 'registers',
              'spilled B', 'blocks per SM (bound)', 'wgmma: HGMMA / QGMMA',
              'mma.sync: HMMA'], rows),
      '',
      f"- {summ['kernels']} kernels; over the 227 KiB of shared memory a"
      f" block may have: {listed(summ['over_shared_memory'])} (largest"
      f" {_f(summ['max_shared_bytes'] / 1024, 4)} KiB); errors:"
      f" {listed(summ['errors'])}.",
      f"- Spilling registers: {listed(summ['spilling'])}.",
      f"- Tensor-core dots on mma.sync only (HMMA, no wgmma):"
      f" {listed(summ['without_wgmma'])}."])


def render_gpu_rehearsal(res: dict) -> str:
  """The `gpu` tests rehearsed on this host (no GPU): each test file's
  outcomes, and the kernels they launched, compiled for an H100 at the
  tests' shapes (one row per kernel name over its distinct compiles)."""
  files: dict = {}
  for nodeid, test in res['tests'].items():
    c = files.setdefault(nodeid.split('::')[0], collections.Counter())
    c[test['outcome']] += 1
    c['launches'] += test['kernel_launches']
  file_rows = [[f'`{name}`', _f(c['passed']), _f(c['failed']),
                _f(c['skipped']), _f(c['launches'])]
               for name, c in sorted(files.items())]
  kernels: dict = {}
  for r in res['rows']:
    name = r.get('kernel') or r['site'].split('(')[0]
    k = kernels.setdefault(name, collections.Counter())
    k['compiles'] += 1
    if 'error' in r:
      k['errors'] += 1
      continue
    k['shared'] = max(k['shared'], r['shared_bytes'])
    k['registers'] = max(k['registers'], r['registers'])
    k['spilling'] += bool(r['spill_store_bytes'])
    k['wgmma'] += bool(r['opcodes']['HGMMA'] or r['opcodes'].get('QGMMA'))
  kernel_rows = [[f'`{name}`', _f(k['compiles']), _f(k['errors']),
                  f"{k['shared'] / 1024:.1f}", _f(k['registers']),
                  _f(k['spilling']), _f(k['wgmma'])]
                 for name, k in sorted(kernels.items())]
  summ = res['summary']
  outcomes = collections.Counter(t['outcome'] for t in res['tests'].values())
  listed = lambda xs: ', '.join(f'`{x}`' for x in xs) or 'none'
  return '\n'.join([
      _table(['test file', 'passed', 'failed', 'skipped',
              'kernel launches lowered'], file_rows),
      '',
      _table(['kernel', 'distinct compiles', 'errors', 'most shared KiB',
              'most registers', 'compiles that spill',
              'compiles on wgmma'], kernel_rows),
      '',
      f"- Tests: {_f(outcomes['passed'])} passed,"
      f" {_f(outcomes['failed'])} failed, {_f(outcomes['skipped'])}"
      f" skipped.",
      f"- {_f(summ['recorded'])} distinct kernels (a kernel at one set of"
      f" shapes and launch parameters) compiled for sm_90a in"
      f" {summ['compile_seconds']:.0f} s; over the 227 KiB of shared"
      f" memory a block may have: {listed(summ['over_shared_memory'])}"
      f" (largest {summ['max_shared_bytes'] / 1024:.1f} KiB); errors:"
      f" {listed(summ['errors'])}."])


def _first_shape(shape: str) -> str:
  """A tuple shape as its first element ('(f32[2], s32[3])' -> 'f32[2],
  ...')."""
  if not shape.startswith('('):
    return shape
  return shape[1:].split(', ')[0] + ', ...'


def render_gpu_launches(res: dict) -> str:
  """What XLA launches on an H100 for each MSA call (compiled on this
  host, no GPU)."""
  rows = []
  for name, out in res['calls'].items():
    if 'error' in out:
      rows.append([name, f"error: {out['error'][:80]}"] + ['-'] * 5)
      continue
    s = out['summary']
    kinds = s['by_kind']
    big = s['largest_glue'][0] if s['largest_glue'] else None
    rows.append([
        name, _f(s['launches']),
        _f(kinds.get('triton', 0) + kinds.get('gemm', 0)
           + kinds.get('library', 0)),
        _f(s['glue_launches']), _bytes(s['glue_bytes']),
        f"{len(s['loops'])} ({_f(s['host_syncs'])})",
        f"`{_first_shape(big['shape'])}` {_bytes(big['bytes'])}" if big
        else '-'])
  return _table(['call', 'launches', 'kernels (Pallas, GEMM, library)',
                 'glue launches', 'glue bytes (read + written)',
                 'loops (host syncs)', 'largest glue launch'], rows)


def render_msa_from_dense(res: dict) -> str:
  sh = res['shapes']
  rows = []
  for r in res['budgets']:
    pct = f"{r['top_k']} of {r['blocks']} ({100 * r['blocks_kept_frac']:.0f}%)"
    rows.append([pct, 'q/k init', _f(r['recall_init']),
                 _f(r['recall_far_init']), _f(r['recall_far_oracle']),
                 _acc(r['acc_msa_init'])])
    rows.append([pct, f"distilled ({_f(r['distill_s'])} s)",
                 _f(r['recall_distilled']),
                 f"**{_f(r['recall_far_distilled'])}**",
                 _f(r['recall_far_oracle']),
                 f"**{_acc(r['acc_msa_distilled'])}**"])
  lines = [
      f"Tiny Qwen3-MoE ({sh['num_layers']} layers, {sh['num_heads']} heads /"
      f" {sh['num_kv_heads']} groups, {sh['num_experts']} experts top-"
      f"{sh['top_k']}, q/k-norm scales starting at"
      f" {_f(sh['qk_norm_init'])}) warm-started on the"
      f" {sh['max_seq_len']}-token word problems: dense greedy accuracy"
      f" **{_acc(res['acc_dense'])}**. Exported, imported with MSA in every"
      f" layer (blocks of {sh['msa_block_size']}), distilled. Recall: share"
      f" of the dense attention mass inside the selected blocks, held-out"
      f" sequences; far: queries that see more than top_k blocks; oracle:"
      f" the best any top_k blocks could keep.", '',
      _table(['blocks kept', 'index branch', 'recall', 'recall (far)',
              'oracle (far)', 'greedy accuracy'], rows), '']
  t = res.get('targets')
  if t:
    q = [r for r in res['budgets']
         if abs(r['blocks_kept_frac'] - 0.25) < 1e-9][0]
    lines.append(
        f"- At 25% of the blocks: recall >= 0.9"
        f" {_met(1.0 if t['recall_ge_0_9'] else 0.0)}"
        f" ({_f(q['recall_distilled'])}); over the far queries"
        f" {_met(1.0 if t['recall_far_ge_0_9'] else 0.0)}"
        f" ({_f(q['recall_far_distilled'])}, of at most"
        f" {_f(q['recall_far_oracle'])}: the distilled indexer keeps"
        f" {100 * q['recall_far_of_oracle']:.0f}% of the oracle's"
        f" mass).")
    lines.append(
        f"- Accuracy within 2 points of dense at 25%, right at the switch:"
        f" {_met(1.0 if t['acc_within_2_points'] else 0.0)}"
        f" ({-q['acc_gap_points']:+.1f} points).")
  lines.append(
      f"- RL with MSA on ({res['rl_top_k']} blocks, the distilled model"
      f" exported and imported as an MSA checkpoint), {res['rl_steps']}"
      f" steps: greedy {_acc(res['acc_msa_before_rl'])} ->"
      f" {_acc(res['acc_msa_after_rl'])}; dense, the same steps:"
      f" {_acc(res['acc_dense'])} -> {_acc(res['acc_dense_after_rl'])}.")
  adapted = ''
  if t:
    adapted = (f"; within 2 points of dense"
               f" {_met(1.0 if t['acc_within_2_points_after_adapt'] else 0.0)}"
               f" ({100 * (res['acc_msa_after_adapt'] - res['acc_dense']):+.1f}"
               f" points)")
  lines.append(
      f"- Or {res['adapt_steps']} supervised steps with sparse attention"
      f" after the switch (every parameter trains"
      f", learning rate {_f(res['adapt_lr'])}): greedy {_acc(res['acc_msa_before_rl'])} ->"
      f" **{_acc(res['acc_msa_after_adapt'])}**{adapted}.")
  return '\n'.join(lines)


_CATEGORY_LABELS = {
    'expert_ffn': 'expert SwiGLU', 'matmul': 'other matmuls',
    'collective': 'collectives', 'copy': 'copies and slices',
    'other': 'elementwise and other'}


def render_profile_rl_step(res: dict) -> str:
  """Shares of the update's op time by category, per method."""
  cats = res['categories']
  rows = [[_METHOD_NAMES.get(m, m), _f(r['update_s'], 3)]
          + [f"{100 * r['shares'][c]:.0f}%" for c in cats]
          for m, r in res['methods'].items()]
  out = [_table(['method', 'update s (traced)']
                + [_CATEGORY_LABELS.get(c, c) for c in cats], rows)]
  for m, r in res['methods'].items():
    top = r['top_ops'][:3]
    out.append(f"- {_METHOD_NAMES.get(m, m)}, costliest ops: " + '; '.join(
        f"`{o['op']}` ({o['category']}, {100 * o['share']:.1f}%,"
        f" {o['count']} calls)" for o in top) + '.')
  return '\n'.join(out)


def render_sampler(res: dict) -> str:
  table = _table(
      ['decode', 'tokens/s'],
      [['KV cache, routing record on', _f(res['cached_tok_s'])],
       ['KV cache, routing record off', _f(res['cached_no_record_tok_s'])],
       [f"recompute the filled prefix per token ({res['prefix_bucket']}-"
        'column widths)', _f(res['recompute_prefix_tok_s'])],
       ['recompute the whole buffer per token', _f(res['recompute_tok_s'])]])
  return '\n'.join([
      table, '',
      f"- Batch {res['batch']}, {res['new_tokens']} new tokens. KV cache vs"
      f" recomputing the prefix: **{_f(res['speedup'])}x** (target"
      f" {_f(res['target_speedup'])}x); vs the whole buffer"
      f" {_f(res['speedup_vs_whole_buffer'])}x. Both decode the cache's"
      f" tokens ({_f(100 * res['recompute_prefix_agreement'])}%,"
      f" {_f(100 * res['recompute_agreement'])}% agree).",
      f"- Recording the routing ({res['routing_record_dtype']},"
      f" {_bytes(res['routing_record_bytes'])}) costs"
      f" {_f(100 * res['routing_record_overhead'], 2)}% of decode time"
      f" (target < {_f(100 * res['target_overhead'])}%).",
  ])


def render_simulate_cluster_validation(res: dict) -> str:
  val = res['validation']
  if val is None:
    return 'Not run (the file was written with `--validate=false`).'
  rows = []
  for m, name in _METHOD_NAMES.items():
    v = val['methods'][m]
    rows.append([name, _f(v['capacity']), _f(v['measured_update_s']),
                 _f(v['predicted_update_s']),
                 f"{100 * v['rel_error_update']:+.1f}%",
                 _f(v['measured_recompute_s']),
                 _f(v['measured_recompute_beside_planner_s']),
                 _f(v['predicted_recompute_s']),
                 f"{100 * v['rel_error_recompute']:+.1f}%",
                 f"{100 * v['rel_error_update_kernels_profile']:+.1f}%"])
  table = _table(['method', 'bucket', 'measured update s', 'predicted s',
                  'error', 'measured recompute s (alone)',
                  'beside the planner s', 'predicted s', 'error',
                  'update error, microbenchmark-only profile'], rows)
  missed = [name for m, name in _METHOD_NAMES.items()
            if max(abs(val['methods'][m]['rel_error_update']),
                   abs(val['methods'][m]['rel_error_recompute'])) > 0.15]
  worst = max(val['max_rel_error_update'], val['max_rel_error_recompute'])
  return '\n'.join([
      table, '',
      "- Fitted on: the static layout's update and recompute on synthetic"
      " routes of skews "
      + ', '.join(f"{r['skew']:g}" for r in val['calibration']['fitted_on'])
      + (' (buckets ' + ', '.join(str(b) for b in val['fit_buckets']) + ')'
         if 'fit_buckets' in val else '')
      + f"; judged on (held out): {val['held_out']}"
      + (' (buckets ' + ', '.join(str(b) for b in val['judged_buckets'])
         + ')' if 'judged_buckets' in val else '') + '.',
      f"- Target: within 15% on every method, update and recompute. Largest"
      f" error {100 * worst:.1f}%: "
      + (f"**missed** by {', '.join(missed)}." if missed else 'met.'),
      f"- ForeMoE vs static update speedup: predicted"
      f" {_f(val['predicted_speedup_update_vs_static'])}x, measured"
      f" {_f(val['measured_speedup_update_vs_static'])}x.",
  ] + ([f"- The host's noise: a method's timings spread over the"
        f" repetitions by at most {100 * val['max_spread']:.0f}% ((max - min)"
        f" / median)."] if val.get('max_spread') is not None else []))


def render_simulate_cluster(res: dict) -> str:
  summ, rows = res['summary'], res['rows']
  profile = summ['assumptions']['profile']['name']
  hw = profile.upper().replace('_', ' ')
  pick = lambda **kw: [r for r in rows if r['profile'] == profile
                       and all(r[k] == v for k, v in kw.items())]
  models = list(dict.fromkeys(r['model'] for r in rows))
  devices = sorted({r['devices'] for r in rows})
  one = lambda **kw: (pick(**kw) or [None])[0]
  big = 64 if 64 in devices else devices[-1]
  t1 = []
  for model in models:
    r = {m: one(model=model, devices=big, mode='exact', method=m)
         for m in _METHOD_NAMES}
    fm = r['foremoe']
    if fm is None:
      continue
    step = lambda m: _f(r[m]['step_s']) if r[m] else 'skipped'
    t1.append([model, step('static'), step('eplb_step'),
               step('eplb_microstep'), step('foresight_split'),
               step('foremoe'),
               f"{_f(fm['speedup_step_vs_static'])}x",
               f"{_f(fm['speedup_step_vs_eplb_step'])}x",
               f"{_f(fm['speedup_step_vs_foresight_split'])}x",
               f"{_f(fm['plan_s'])} ({_f(fm['recompute_s'])})",
               _f(fm['transfer_exposed_s']),
               _bytes(fm['peak_bytes_per_device'])])
  t2 = []
  for model in models:
    cells = []
    for d in devices:
      rg = one(model=model, devices=d, mode='exact', method='foremoe')
      pd = one(model=model, devices=d, mode='padded', method='foremoe')
      cells.append('-' if rg is None else
                   f"{rg['speedup_step_vs_eplb_step']:.2f}"
                   + ('' if pd is None else
                      f" ({pd['speedup_step_vs_eplb_step']:.2f})"))
    t2.append([model] + cells)
  t3 = []
  for model in models:
    before = one(model=model, devices=big, mode='exact',
                 method='foremoe_before_fixes')
    now = one(model=model, devices=big, mode='exact', method='foremoe')
    if before and now:
      t3.append([model, _f(before['step_s']), _f(before['reverted_moves']),
                 _f(now['step_s']), _f(now['reverted_moves'])])
  out = [
      f"**Predicted on {big} {hw}s, exact-count dispatch**"
      " (whole step = recompute + plan wait + update; rollout excluded):", '',
      _table(['model', 'static step s', 'EPLB-step s', 'EPLB-microstep s',
              'foresight split s', 'ForeMoE s', 'ForeMoE vs static',
              'vs EPLB-step', 'vs foresight split',
              'ForeMoE plan s (recompute s)', 'exposed moves s',
              'peak memory / device'], t1), '',
      f"**ForeMoE step speedup vs EPLB-step by device count** ({hw},"
      " exact-count dispatch; padded layer in brackets):", '',
      _table(['model'] + [str(d) for d in devices], t2)]
  if t3:
    out += ['', f"**ForeMoE before / after the planner fixes** ({big}"
            f" {hw}s; slot changes undone to fit the move budget):", '',
            _table(['model', 'before: step s', 'before: undone',
                    'now: step s', 'now: undone'], t3)]
  out += ['', f"- Headline (Qwen3-30B-A3B, 64 {hw}s,"
          f" {summ['dispatch_64gpu']}-count dispatch): ForeMoE step"
          f" **{_f(summ['speedup_64gpu_foremoe_vs_static'])}x** vs static EP,"
          f" **{_f(summ['speedup_64gpu_foremoe_vs_eplb_step'])}x** vs"
          f" step-level EPLB,"
          f" {_f(summ['speedup_64gpu_foremoe_vs_foresight_split'])}x vs the"
          f" foresight split without moves; update alone"
          f" {_f(summ['update_speedup_64gpu_foremoe_vs_static'])}x and"
          f" {_f(summ['update_speedup_64gpu_foremoe_vs_eplb_step'])}x; peak"
          f" memory {_bytes(summ['peak_bytes_per_device_64gpu'])} per device."
          f" With the padded layer:"
          f" {_f(summ['speedup_64gpu_foremoe_vs_static_padded'])}x and"
          f" {_f(summ['speedup_64gpu_foremoe_vs_eplb_step_padded'])}x. The"
          f" paper reports up to {_f(summ['paper_speedup_64gpu'])}x on 64 GPUs."]
  if 'inter_node_recv_max_over_mean_64gpu_foremoe' in summ:
    out += [f"- What bounds it: the all-to-alls are"
            f" {100 * summ['all_to_all_share_of_update_64gpu_foremoe']:.0f}%"
            f" of ForeMoE's update, and across nodes they run at the"
            f" inter-node link's rate, so the rows that cross nodes set"
            f" their time, not the rows a device computes or sends in all."
            f" ForeMoE balances what devices compute"
            f" ({_f(summ['microstep_max_over_mean_64gpu_foremoe'])}x the"
            f" mean; EPLB-step"
            f" {_f(summ.get('microstep_max_over_mean_64gpu_eplb_step', 0))}x)"
            f" and keeps"
            f" {100 * summ['on_node_row_fraction_64gpu_foremoe']:.0f}% of"
            f" the rows inside their node (EPLB-step"
            f" {100 * summ.get('on_node_row_fraction_64gpu_eplb_step', 0):.0f}%),"
            f" but the rows that cross are not balanced: the busiest"
            f" inter-node receiver takes"
            f" {_f(summ['inter_node_recv_max_over_mean_64gpu_foremoe'])}x the"
            f" mean and the busiest inter-node sender"
            f" {_f(summ['inter_node_send_max_over_mean_64gpu_foremoe'])}x,"
            f" where the rows a device sends in all vary only"
            f" {_f(summ['sender_max_over_mean_64gpu'])}x. An expert's only"
            f" copy draws rows from every other node, while a replica"
            f" serves its own node's sources first (means over micro-steps"
            f" and layers: `inter_node_*` and `on_node_row_fraction` in the"
            f" rows)."]
    if 'speedup_64gpu_foremoe_vs_compute_anchor' in summ:
      out[-1] += (
          f" ForeMoE's anchor therefore places replicas where their tokens"
          f" come from (`ForeMoEConfig.anchor_inter_node_weight`): packed on"
          f" compute rows alone (the `foremoe_compute_anchor` row) they keep"
          f" {100 * summ['on_node_row_fraction_64gpu_compute_anchor']:.0f}%"
          f" of the rows on node, the busiest inter-node receiver takes"
          f" {_f(summ['inter_node_recv_max_over_mean_64gpu_compute_anchor'])}x"
          f" the mean, and the step is"
          f" {_f(summ['speedup_64gpu_foremoe_vs_compute_anchor'], 3)}x"
          f" slower: fewer rows cross, though less evenly.")
  if 'wire_bytes_over_useful_max' in summ:
    shares = summ['transfer_exposed_share_of_update_max']
    out += [f"- Expert moves ({summ['transfer_mode']} transfers): experts on"
            f" the wire over experts that moved, worst row"
            f" {_f(summ['wire_bytes_over_useful_max'], 3)}; exposed transfer"
            f" (the update's fill, what the last micro-step's backward"
            f" does not hide of the flush of the replicas' gradients, moves"
            f" beyond the overlap window, and what the recompute's forward"
            f" does not hide of its prefill of the update's slots), worst"
            f" method, as a share of the update: "
            + ', '.join(f"{100 * v:.1f}% at {d} devices"
                        for d, v in shares.items()) + '.']
    w = summ.get('transfer_exposed_worst')
    if w:
      out += [f"- Worst at {w['devices']} devices ({w['model']},"
              f" {w['method']}, {w['profile']}):"
              f" {_f(w['transfer_exposed_s'])} s exposed of a"
              f" {_f(w['update_s'])} s update: the update's fill"
              f" {_f(w['fill_s'])} s, the flush"
              f" {_f(w.get('flush_exposed_s', w['flush_s']))} of"
              f" {_f(w['flush_s'])} s (the rest under the last backward),"
              f" moves {_f(w['moves_exposed_s'])} s, the prefill"
              f" {_f(w['prefill_exposed_s'])} of {_f(w['prefill_s'])} s"
              f" (the rest under the recompute's forward)."]
  largest = summ.get('planning_largest_ep') or {}
  if largest:
    workers = {p['planner_workers'] for p in largest.values()}
    out += [f"- Host planning at each model's largest EP group (ForeMoE,"
            f" measured on the host that ran this,"
            f" {'/'.join(map(str, sorted(workers)))} planner worker(s)):"
            f" step-level plan before the recompute (exposed) /"
            f" micro-step plan / the recompute it hides behind: "
            + '; '.join(f"{model} EP {p['ep']}"
                        f" {_f(p['recompute_plan_s'])} s /"
                        f" {_f(p['plan_s'])} s / {_f(p['recompute_s'])} s"
                        for model, p in largest.items()) + '.']
  return '\n'.join(out)


def render_sweep_moves(res: dict) -> str:
  summ, rows = res['summary'], res['rows']
  step = lambda r, m: _f(r['step_s'].get(m)) if r['step_s'].get(m) else (
      'failed' if m in r['errors'] else '-')
  # Four decimals throughout: the ratios sit within a few percent of 1.
  ratio = lambda x: '-' if x is None else (f'**{x:.4f}**' if x > 1.0
                                           else f'{x:.4f}')
  delta = lambda r, k: (f"{r['foremoe_minus_split_s'][k]:+.3f}"
                        if 'foremoe_minus_split_s' in r else '-')
  mm = lambda r, m: _f(r['microstep_max_over_mean'].get(m), 4)
  table = []
  for r in rows:
    fm = r.get('foremoe_transfer_exposed_s') is not None
    table.append([
        r['model'], _f(r['devices']), _f(r['redundant_slots_per_device']),
        f"{r['seqs_per_microbatch']} x {_f(r['tokens_per_seq'])}",
        step(r, 'static'), step(r, 'eplb_step'), step(r, 'foresight_split'),
        step(r, 'foremoe'), ratio(r['foremoe_vs_foresight_split_step']),
        ratio(r['foremoe_vs_foresight_split_update']),
        f"{mm(r, 'foresight_split')} -> {mm(r, 'foremoe')}",
        f"{delta(r, 'moe_compute_s')} / {delta(r, 'all_to_all_s')} /"
        f" {delta(r, 'transfer_exposed_s')}",
        _f(r['foremoe_move_s']) if fm else '-',
        _f(r['foremoe_transfer_exposed_s']) if fm else '-',
        _f(r['foremoe_wire_bytes_over_useful']) if fm else '-',
        _f(r['plan_s'].get('foremoe'))])
  out = [
      _table(['model', 'devices', 'redundant slots / device',
              'sequences x tokens / device / micro-step', 'static step s',
              'EPLB-step s', 'foresight split s', 'ForeMoE s',
              'ForeMoE vs split, step', 'update',
              'micro-step max/mean, split -> ForeMoE',
              'ForeMoE - split s: expert compute / all-to-all / exposed'
              ' moves', 'ForeMoE moves s (hidden + exposed)',
              'ForeMoE exposed transfer s', 'wire / useful',
              'ForeMoE plan s'], table), '']
  if 'best_foremoe_vs_foresight_split_step' in summ:
    out.append(
        f"- The moves win (ForeMoE's step faster than foresight split's) in"
        f" {summ['rows_where_moves_win']} of {summ['rows_scored']} cells;"
        f" the update alone (device side, no host timing) in"
        f" {summ['rows_where_moves_win_update']} and loses in"
        f" {summ['rows_where_moves_lose_update']}. Best"
        f" **{summ['best_foremoe_vs_foresight_split_step']:.4f}x**"
        f" (`{summ['best_row_key']}`), worst"
        f" {summ['min_foremoe_vs_foresight_split_step']:.4f}x"
        f" (`{summ['min_row_key']}`); {_f(summ['target_ratio'])}x reached in"
        f" some cell: {_f(summ['meets_1_05_in_some_row'])}.")
  asm = summ['assumptions']
  out.append(
      f"- {asm['profile']['name'].upper().replace('_', ' ')} profile,"
      f" {asm['dispatch']}-count dispatch, {asm['num_microsteps']}"
      f" micro-steps, {asm['trace']}. Step seconds include planning"
      f" measured on the host that ran the sweep: both methods make the"
      f" recompute's step-level plan with the same code, "
      + ("measured once and charged to both, so the step ratio differs from"
         " the update's only by the recompute both run and any planning"
         " left exposed"
         if not summ.get('step_timing_noise_max', 0) else
         f"and their measured times differ by up to"
         f" {100 * summ['step_timing_noise_max']:.2f}% of the step, so step"
         f" ratios that close to 1 are timing noise")
      + "; the update ratio is device-side only.")
  if summ['rows_with_errors']:
    out.append('- Methods that could not run: ' + '; '.join(
        f"`{r['key']}` {m}: {why}" for r in rows
        for m, why in r['errors'].items()) + '.')
  out.append('- Plot: ' + ', '.join(f'[{os.path.basename(p)}]({p})'
                                    for p in summ['plots']) + '.')
  return '\n'.join(out)


def render_soak(res: dict) -> str:
  rss, dev = res['rss'], res['device_bytes']
  table = _table(
      ['after warm-up', 'level', 'trend growth', 'Mann-Kendall p'],
      [['process RSS (compiles left out)', _bytes(rss['level']),
        f"{100 * res['rss_growth']:+.2f}%", f"{rss['p_value']:.1e}"],
       ['live device buffers', _bytes(dev['level']),
        f"{100 * res['device_bytes_growth']:+.2f}%", f"{dev['p_value']:.1e}"]])
  return '\n'.join([
      table, '',
      f"- {res['steps']} RL steps, the first {res['warmup_steps']} left out;"
      f" {res['checkpoint_saves']} checkpoint saves (every"
      f" {res['checkpoint_every']} steps). RSS trend:"
      f" {100 * res['rss_growth_per_1k_steps']:+.2f}% per 1,000 steps"
      f" (Mann-Kendall p {rss['p_value']:.1e}); target: not significant"
      f" (p > 0.01) or under +0.5% per 1,000 steps:"
      f" {'met' if res['target_met'] else 'NOT met'}."
      f" {res['compile_steps_after_warmup']} step(s) after warm-up compiled"
      f" (a new capacity bucket, the first checkpoint): the samples from"
      f" each compile to the heap trim after the next save"
      f" ({res.get('samples_left_out_after_compiles', 0)}) are left out,"
      f" and no pair of samples across a compile enters the fit; the"
      f" lasting level shift is {_bytes(res['compile_shift_bytes'])}."
      f" The raw fit, compiles included, reads"
      f" {100 * res['rss_growth_with_compiles']:+.1f}%.",
  ])


def render_rewards(res: dict) -> str:
  rows = [['in-process', '1', _f(res['in_process_step_s']), '1.00', '-']]
  rows += [[f"{w['workers']} worker process(es)", str(w['workers']),
            _f(w['step_s']), _f(w['speedup'], 2),
            _f(w['first_call_with_startup_s'])] for w in res['workers']]
  table = _table(['verifier', 'processes', 'step s', 'speedup',
                  'first call incl. start-up s'], rows)
  return '\n'.join([
      table, '',
      f"- {res['completions']} GSM8K-shaped completions"
      f" ({res['mean_completion_chars']:.0f} characters on average) scored by"
      f" `{res['reward']}`: {_f(res['in_process_ms_per_completion'], 2)} ms"
      f" each in-process; the sympy-free `numeric` verifier takes"
      f" {_f(res['numeric_step_s'])} s for all of them. The trainer scores"
      f" while the device recomputes, so a step pays only what scoring takes"
      f" beyond the recompute."])


def render_memory_report(res: dict) -> str:
  rep = res['report']
  rows = []
  for depth, c in res['check'].items():
    rows.append([depth, _bytes(c['model']['total']), _bytes(c['xla']['peak']),
                 f"{100 * c['rel_error_model_vs_xla']:+.1f}%",
                 _f(res['compile_s_by_layers'][depth])])
  full = res['model_full_depth']
  top = sorted(((v, k) for k, v in full.items() if k != 'total'),
               reverse=True)[:4]
  peak = res['peak_bytes_per_device']
  return '\n'.join([
      _table(['layers', 'memory model', 'XLA (compiled step)',
              'model vs XLA', 'compile s'], rows), '',
      f"- {rep['config']}, EP {rep['ep']},"
      f" {_f(rep['seqs_per_device'] * rep['tokens_per_seq'])} tokens per"
      f" device per micro-step, remat {rep['remat_policy']}.",
      f"- At {res['num_layers']} layers: model {_bytes(full['total'])}"
      f" (largest: " + ', '.join(f'{k} {_bytes(v)}' for v, k in top) + ');'
      + (f" XLA's compiled step {_bytes(res['xla_full_depth'])}, compiled in"
         f" {_f(res['compile_s_full_depth'])} s;"
         if res.get('xla_full_depth_compiled') else '')
      + f" XLA's peak extrapolated from the reduced depths along its"
      f" per-layer slope ({_bytes(res['xla_bytes_per_layer'])} a layer,"
      f" model {_bytes(res['model_bytes_per_layer'])})"
      f" {_bytes(res['xla_extrapolated_full_depth'])}.",
      *_moves_in_layers_lines(res),
      f"- Peak per device (the largest): **{_bytes(peak)}**; fits an 80 GB"
      f" H100 with 10% headroom: {_f(res['fits_80gb_with_10pct_headroom'])}.",
      f"- Compile time from {min(res['compile_s_by_layers'], key=int)} to"
      f" {max(res['compile_s_by_layers'], key=int)} layers:"
      f" x{_f(res['compile_growth'])} (the layers are scanned).",
  ])


def _moves_in_layers_lines(res: dict) -> list[str]:
  """The update compiled as GPU/TPU run it."""
  parts = []
  for depth, c in res['check_moves_in_layers'].items():
    over, rel = c['over_emulation_bytes'], c['rel_error_model_vs_xla']
    parts.append(f"{depth} layers {_bytes(c['xla']['peak'])}"
                 f" ({'+' if over >= 0 else '-'}{_bytes(abs(over))} vs the"
                 f" CPU emulation's; model {100 * rel:+.1f}%)")
  return ["- As GPU/TPU run it (the moves' fills in the layers' forward, the"
          " next micro-step's slots alive through the backward; a stand-in"
          " of the ragged collective's buffers): XLA " + ', '.join(parts)
          + '.']


def _clock(seconds: float) -> str:
  m, s = divmod(round(seconds), 60)
  return f'{m} min {s} s' if m else f'{s} s'


def _acc(x) -> str:
  """An accuracy or reward in [0, 1], always three decimals."""
  return '-' if x is None else f'{x:.3f}'


def render_demo(res: dict) -> str:
  """The main job (`make demo`) or its dataset variant, from one run."""
  c, n, w = res['config'], res['steps'], res['reward_window']
  what = ('greedy accuracy' if c['task'] != 'dataset'
          else 'greedy accuracy (math-verify)')
  table = _table(
      ['', f"after the {_f(c['warmstart_steps'])}-step warm start",
       f'after {n} GRPO steps'],
      [[f"{what}, {_f(c['eval_prompts'])} held-out prompts",
        _acc(res['greedy_before_rl']), f"**{_acc(res['greedy_after_rl'])}**"],
       [f'sampled reward, mean of {w} steps',
        f"{_acc(res['reward_first'])} (steps 1-{w})",
        f"{_acc(res['reward_last'])} (steps {n - w + 1}-{n})"]])
  timing = (f"{_clock(res['wall_s'])} wall-clock from the command's start"
            ' (set-up, warm start and compiles included)'
            if res.get('wall_s') is not None else 'not timed')
  step = (f"; {_f(res['step_s_median'])} s per GRPO step after"
          ' compilation (median)' if res.get('step_s_median') else '')
  undone = res['reverted_moves']
  return '\n'.join([
      f"Run: `{res['train_command']}`: {timing}{step}.", '',
      table, '',
      f"- A {c['num_layers']}-layer MoE ({c['num_experts']} experts, top-"
      f"{c['top_k']}, {c['slots_per_device']} slots per device) on a"
      f" ('data', 'expert') = ({c['num_data']}, {c['num_expert']}) mesh;"
      f" each step samples {c['prompts_per_step']} prompts x"
      f" {c['num_generations']} and updates in {c['num_microbatches']}"
      f" micro-steps, planned by `{c['planner']}`.",
      f"- Micro-step max/mean device load, mean over the run: the plans"
      f" **{_f(res['microstep_max_over_mean'])}**, static expert parallelism"
      f" {_f(res['microstep_max_over_mean_static'])}. Capacity bucket (rows a"
      f" device receives): {_f(res['capacity_mean'])} on average, static EP"
      f" {_f(res['capacity_static_mean'])}.",
      f"- Weights moved: {_bytes(res['weight_bytes_moved'])} per device per"
      f" micro-step; gradients returned:"
      f" {_bytes(res['grad_bytes_returned'])}.",
      f"- Planning (medians): the micro-step plan"
      f" {_f(1e3 * res['plan_s_median'])} ms, made while the recompute"
      f" runs{_step_level_plan(res)}; the update waited for it on"
      f" {res['steps_waited_for_plan']} of"
      f" {n} steps (longest wait {_f(1e3 * res['plan_wait_s_max'], 2)} ms);"
      f" planner fallbacks: {res['plan_fallbacks']}.",
      f"- Slots holding the wrong expert: {res['transfer_id_errors']};"
      f" tokens dropped: {res['dropped']}; slot changes undone to fit the"
      f" move budget: {undone} in {n} steps. Largest gap between the"
      f" sampler's log-probs and the replayed recompute's:"
      f" {_f(res['replay_logp_gap_max'], 2)}.",
      f"- Plots in the workdir: "
      + ', '.join(f'`{p}`' for p in res['plots']) + '.',
  ])


# ----------------------------------------------------- blocks over many files

# Where each headline row's details are: a docs/results.md section (the
# anchor GitHub makes of its heading) and the results file.
_DETAILS = 'docs/results.md'


def _ms(seconds) -> str:
  return '-' if seconds is None else _f(1e3 * seconds)


def render_gpu_check(results_dir: str, name: str) -> str:
  """A `make gpu-check` summary (results/gpu_check*.json, written by
  scripts/gpu_check_summary.py, not by results.save): setup, tests, and
  the bench's rows, whole or as far as a cut-off run got."""
  path = os.path.join(results_dir, f'{name}.json')
  with open(path) as f:
    rec = json.load(f)
  setup, tests, bench = rec['setup'], rec['tests'], rec['bench_msa']
  pk = setup.get('packages', {})
  lines = [f"`{rec.get('command', 'make gpu-check')}` · {rec.get('date', '?')}"
           f" · {setup.get('device_kind', '?')} · jax {setup.get('jax', '?')},"
           f" triton {pk.get('triton', '?')} · file `results/{name}.json`", '',
           f"gpu tests: {tests.get('passed', 0)} passed,"
           f" {tests.get('failed', 0)} failed,"
           f" {tests.get('skipped', 0)} skipped · gpu-check:"
           f" **{rec.get('gpu_check', '?')}**"]
  rerun = rec.get('tests_rerun')
  if rerun:
    lines += ['', f"Re-run (`{rerun.get('command', '?')}`;"
              f" {rerun.get('code', '')}): {rerun.get('passed', 0)} passed,"
              f" {rerun.get('failed', 0)} failed"
              + (': ' + ', '.join(f'`{t.split("::")[-1]}`'
                                  for t in rerun.get('failed_tests', []))
                 if rerun.get('failed_tests') else '') + '.']
  # The final JSON, or the per-phase rows of a run cut short (older runs
  # wrote per-length rows with decode fields and no 'phase').
  # pylint: disable-next=g-import-not-at-top (jax only for this section)
  from pallas_kernels.msa import benchmark_gpu
  rows, decode = benchmark_gpu.phase_rows(bench)
  if not rows and not decode:
    old = [r for r in bench.get('partial', []) if 'phase' not in r]
    rows = [r for r in old if 'seq_len' in r]
    decode = [{**r, 'cache_len': r['seq_len']} for r in rows
              if 'decode_msa_s' in r]
  if 'error' in bench:
    lines += ['', f"The bench did not finish ({bench['error']}); the rows it"
              ' wrote before it stopped:']
  ceil = bench.get('ceilings') or {}
  if 'matmul_tflops' in ceil:
    lines += ['', f"Ceilings: bf16 {ceil['matmul_n']}^3 matmul"
              f" {_f(ceil['matmul_tflops'])} TFLOP/s; copy"
              f" {_f(ceil['copy_gbps'])} GB/s (read + write)."]
  chk = bench.get('reference_check') or next(
      (r['reference_check'] for r in bench.get('partial', [])
       if 'reference_check' in r), {})
  if 'selection_flip_rate' in chk:
    lines += ['', f"Check at {chk.get('check_len', '?')} tokens: selection"
              f" margin violations {chk['selection_margin_violations']},"
              f" flip rate {_f(chk['selection_flip_rate'])}; main branch max"
              f" abs error {_f(chk['max_abs_err'], 2)}."
              + (f" fp8 index scores: margin violations at eps 2^-3"
                 f" {chk['fp8_margin_violations']}, flip rate"
                 f" {_f(chk['fp8_flip_rate'])}."
                 if 'fp8_flip_rate' in chk else '')]
  elif 'selection_equal' in chk:
    lines += ['', f"Check at 2,048 tokens: selection equal to the reference:"
              f" {_f(chk['selection_equal'])}; max abs error"
              f" {_f(chk['max_abs_err'], 2)}."]
  tune = bench.get('tune') or next(
      (r for r in bench.get('partial', []) if r.get('phase') == 'tune'), {})
  if tune.get('speedup_vs_default'):
    ranked = sorted(tune['speedup_vs_default'].items(), key=lambda kv: -kv[1])
    lines += ['', f"Tune at {_f(tune['tune_len'])} tokens: the KV-outer"
              " forward's variants, each timed beside the default (speedup"
              ' over it): ' + '; '.join(f'`{k}` {_f(v)}x' for k, v in ranked)
              + (f". Fastest: `{tune['best']}`, timed again below as the"
                 ' tuned forward.' if 'best' in tune
                 else '. None beat the default.')
              + (f" Not timed (budget): {len(tune['not_timed'])}."
                 if tune.get('not_timed') else '')]
  done = [r for r in rows if 'speedup' in r]
  if done:
    cols = [('dense prefill ms (cuDNN)', lambda r: _ms(r['dense_s'])),
            ('MSA prefill ms', lambda r: _ms(r['msa_s'])),
            # Runs before the two-launch selector timed only the fused one,
            # as index_s, in rows without a phase.
            ('index ms', lambda r: _ms(r.get('index_s')) if 'phase' in r
             else '-'),
            ('index TFLOP/s', lambda r: _f(r.get('index_tflops'))),
            ('index stages ms: scores / top-k', lambda r: (
                f"{_ms(r['index_scores_s'])} / {_ms(r.get('index_topk_s'))}"
                if 'index_scores_s' in r else '-')),
            ('fused index ms', lambda r: _ms(
                r.get('index_fused_s') if 'phase' in r else r['index_s'])),
            ('main ms', lambda r: _ms(r.get('main_s'))),
            ('main stages ms: plan / kernel / combine', lambda r: (
                f"{_ms(r['main_plan_s'])} / {_ms(r.get('main_kernel_s'))}"
                f" / {_ms(r.get('main_combine_s'))}"
                if 'main_plan_s' in r else '-')),
            ('per-token main ms', lambda r: _ms(r.get('main_token_s'))),
            # The union-tile forward against KV-outer, on the bench's
            # selection and on one its tiles share (best case).
            ('union tiles main ms: this / shared selection (x KV-outer);'
             ' blocks per slot', lambda r: (
                 f"{_ms(r['main_tiles_s'])}"
                 f" ({_f(r.get('tiles_speedup'))}x) /"
                 f" {_ms(r.get('main_tiles_shared_s'))}"
                 f" ({_f(r.get('tiles_shared_speedup'))}x);"
                 f" {_f(r.get('tiles_union_per_k'))}"
                 if 'main_tiles_s' in r else '-')),
            ('**speedup**', lambda r: f"**{_f(r['speedup'])}**"),
            ('tuned: main ms / speedup', lambda r: (
                f"{_ms(r['main_tuned_s'])} / {_f(r.get('speedup_tuned'))}"
                if 'main_tuned_s' in r else '-')),
            ('FLOP ratio', lambda r: _f(r['flop_ratio'])),
            ('fwd+bwd ms: dense / MSA main',
             lambda r: (f"{_ms(r['dense_train_s'])} / {_ms(r['msa_train_s'])}"
                        if 'msa_train_s' in r else '-')),
            ('fwd+bwd ms, per-token atomics',
             lambda r: _ms(r.get('msa_train_token_s'))),
            ('bwd kernels ms: dQ / dK,dV (prefetch / 2 key parts)',
             lambda r: (
                 f"{_ms(r['bwd_dq_s'])} / {_ms(r.get('bwd_dkv_s'))}"
                 f" ({_ms(r.get('bwd_dkv_prefetch_s'))} / "
                 f"{_ms(r.get('bwd_dkv_parts2_s'))})"
                 if 'bwd_dq_s' in r else '-')),
            ('dQ ms by union tiles: this / shared selection (per-token'
             ' there)', lambda r: (
                 f"{_ms(r['bwd_dq_tiles_s'])} /"
                 f" {_ms(r.get('bwd_dq_tiles_shared_s'))}"
                 f" ({_ms(r.get('bwd_dq_shared_s'))})"
                 if 'bwd_dq_tiles_s' in r else '-'))]
    lines += ['', _table(['seq_len', *[c[0] for c in cols]],
                         [[_f(r['seq_len']), *[c[1](r) for c in cols]]
                          for r in done])]
  for r in done:
    if r.get('index_scores_variants') or r.get('index_scores_variants_wrong'):
      ranked = sorted(r['index_scores_variants'].items(), key=lambda kv: -kv[1])
      lines += ['', f"Index score launch at {_f(r['seq_len'])} tokens, its"
                ' tilings each beside the default (speedup over it): '
                + ('; '.join(f'`{k}` {_f(v)}x' for k, v in ranked) or 'none')
                + (f"; scores differing from the default's:"
                   f" {', '.join(r['index_scores_variants_wrong'])}"
                   if r.get('index_scores_variants_wrong') else '') + '.']
  ddone = [r for r in decode if 'decode_speedup' in r]
  if ddone:
    lines += ['', _table(
        ['decode cache', 'batch', 'dense ms', 'MSA ms', 'index ms',
         'main ms', 'MSA on XLA-built tables ms', '**speedup**',
         'fastest variant: speedup', 'FLOP ratio', 'unaligned cache: time x'],
        [[_f(r['cache_len']), _f(r.get('batch', 8)), _ms(r['decode_dense_s']),
          _ms(r['decode_msa_s']), _ms(r.get('decode_index_s')),
          _ms(r.get('decode_main_s')),
          _ms(r.get('decode_msa_tiled_decode_s')),
          f"**{_f(r['decode_speedup'])}**",
          (f"`{r['decode_best']}`: {_f(r['decode_speedup_best'])}"
           if 'decode_best' in r else '-'),
          _f(r['decode_flop_ratio']), _f(r.get('unaligned_cost'))]
         for r in ddone])]
  broken = [(r, name, err) for r in [*rows, *decode]
            for name, err in r.get('kernel_errors', {}).items()]
  if broken:
    lines += ['', 'Failed (the rest of its row was still timed): ' + '; '.join(
        f"{name} at {r.get('seq_len', r.get('cache_len', ''))}"
        f" ({err[:80]})" for r, name, err in broken) + '.']
  if rows or decode:
    lines += ['', _table(
        ['target: speedup vs cuDNN', 'FLOP ratio', 'measured', 'target',
         'met', 'best variant', 'met by it', 'with fp8 index scores'],
        [[t['what'], _f(t['flop_ratio']),
          f"**{_f(t['measured'])}**" if t['measured'] is not None else '-',
          f">= {_f(t['target'])}", _f(t['met']), _f(t['best']),
          _f(t['best_met']), _f(t['with_fp8_index'])]
         for t in benchmark_gpu.targets(bench)])]
  # What each phase cost (compiles included): what the next run's budget
  # has to fit.
  phases = bench.get('partial') or [ceil, chk, tune, *rows, *decode]
  walls = [(r.get('phase'), r.get('seq_len', r.get('cache_len', r.get(
      'tune_len', ''))), r['elapsed_s'])
           for r in phases if 'elapsed_s' in r and r.get('phase')]
  if 'partial' not in bench:
    walls += [('train', r['seq_len'], r['train_elapsed_s']) for r in rows
              if 'train_elapsed_s' in r]
  if walls:
    lines += ['', 'Wall time per phase, compiles included: ' + '; '.join(
        f"{name}{' ' + _f(n) if n != '' else ''} {_f(sec)} s"
        for name, n, sec in walls) + '.']
  prof = bench.get('profile') or next(
      (r for r in bench.get('partial', []) if r.get('phase') == 'profile'),
      None)
  if prof and prof.get('profiles'):
    lines += ['', _profile_table(prof)]
  mos = bench.get('mosaic') or [
      r for r in bench.get('partial', []) if r.get('phase') == 'mosaic']
  if mos:
    lines += ['', _mosaic_table(mos)]
  # A forward+backward cut off inside a measured prefill row says so too.
  cut = [(r.get('phase', '?'), r) for r in [*rows, *decode]
         if 'skipped' in r or 'error' in r]
  cut += [('train', {'seq_len': r['seq_len'],
                     'skipped': r.get('train_skipped'),
                     'error': r.get('train_error', '')})
          for r in rows if 'train_skipped' in r or 'train_error' in r]
  if cut:
    lines += ['', 'Not measured: ' + '; '.join(
        f"{name} {r.get('seq_len', r.get('cache_len', ''))}"
        f" ({r.get('skipped') or r.get('error', '')[:80]})" for name, r in cut)
        + '.']
  gemm = rec.get('bench_grouped_gemm')
  if gemm:
    lines += ['', _grouped_gemm_text(gemm)]
  return '\n'.join(lines)


def _grouped_gemm_text(gemm: dict) -> str:
  """gpu-check's grouped-GEMM bench (foremoe_jax/benchmarks/grouped_gemm):
  each kind beside the dense batched GEMM of the same rows, or why it has
  no times."""
  sh = gemm.get('shape', {})
  head = ('Expert compute, forward+backward (`experiments.bench_grouped_gemm'
          ' --device=gpu`; one device\'s rows of an MoE layer: '
          f"{_f(sh.get('live_rows'))} routed rows in a buffer of"
          f" {_f(sh.get('rows'))}, {_f(sh.get('slots'))} slots, model dim"
          f" {_f(sh.get('model_dim'))}, expert dim {_f(sh.get('hidden_dim'))},"
          f" {sh.get('dtype', '?')})")
  if 'seconds' not in gemm:
    why = gemm.get('skipped') or gemm.get('error') or gemm.get('errors')
    return f'{head}: not measured ({str(why)[:200]}).'
  sec, check = gemm['seconds'], gemm.get('check', {})
  rows = [[f'`{k}`', _ms(v), _f(gemm['tflops'][k]),
           _f(gemm.get('efficiency_vs_batched', {}).get(k, 1.0)),
           _f(check[k], 2) if k in check else '-']
          for k, v in sorted(sec.items(), key=lambda kv: kv[1])]
  text = head + ':\n\n' + _table(
      ['kind', 'ms', 'useful TFLOP/s', 'batched GEMM time / its time',
       'error vs f32'], rows)
  if gemm.get('errors'):
    text += '\n\nNot timed: ' + '; '.join(
        f'`{k}` ({str(v)[:80]})' for k, v in gemm['errors'].items()) + '.'
  return text


def _mosaic_table(rows: list[dict]) -> str:
  """The bench's mosaic phase: the Mosaic GPU kernels beside the Triton
  ones (a speedup shows only where the results agreed)."""
  cell = lambda r, key, fmt=_f: fmt(r[key]) if key in r else '-'
  table = _table(
      ['tokens', 'index scores ms (Triton / Mosaic)', 'speedup',
       'main ms (Triton / Mosaic)', 'speedup', 'Mosaic main TFLOP/s',
       'MSA vs cuDNN (Triton / Mosaic)'],
      [[_f(r['seq_len']),
        f"{cell(r, 'index_scores_s', _ms)} / "
        f"{cell(r, 'index_scores_mosaic_s', _ms)}",
        cell(r, 'index_scores_mosaic_speedup'),
        f"{cell(r, 'main_s', _ms)} / {cell(r, 'main_mosaic_s', _ms)}",
        cell(r, 'main_mosaic_speedup'), cell(r, 'main_mosaic_tflops'),
        f"{cell(r, 'speedup')} / {cell(r, 'speedup_mosaic')}"]
       for r in rows if 'seq_len' in r])
  notes = []
  for r in rows:
    for key, what in (('mosaic_wrong', 'disagreed with Triton'),
                      ('mosaic_not_applicable', 'not run'),
                      ('kernel_errors', 'failed'), ('error', 'stopped'),
                      ('skipped', 'skipped')):
      if r.get(key):
        val = r[key]
        val = ', '.join(val) if isinstance(val, (list, dict)) else val
        notes.append(f"{_f(r.get('seq_len', 0))} tokens, {what}: {val}")
  return ('The Mosaic GPU kernels (index_mosaic, kv_outer_mosaic) beside the'
          ' Triton ones, timed together:\n\n' + table
          + (''.join(f'\n- {n}' for n in notes) if notes else ''))


def _profile_table(prof: dict) -> str:
  """The bench's profile phase: per traced call, its span, the time some
  kernel ran, the idle share between launches, and the costliest kernels."""
  rows = []
  for what, p in prof['profiles'].items():
    top = '; '.join(f"`{k['name'][:40]}` {_f(k['us'])} us x{_f(k['launches'])}"
                    for k in p['top'][:4])
    rows.append([what, _f(p['span_us']), _f(p['busy_us']),
                 _f(p['idle_share']), _f(p['kernels']), top])
  calls = next(iter(prof['profiles'].values()))['calls']
  source = next(iter(prof['profiles'].values()))['source']
  return (f'Where one call\'s time goes ({source} trace of {calls}'
          ' back-to-back calls, per call; idle: no kernel running between'
          ' the first start and the last end):\n\n' + _table(
              ['call', 'span us', 'busy us', 'idle', 'launches',
               'costliest kernels (us, launches per call)'], rows))


def _link(section: str, bench: str) -> str:
  return (f'[{section}]({_DETAILS}#{section.lower().replace(" ", "-")}),'
          f' [`{bench}.json`](results/{bench}.json)')


def render_headline(results_dir: str) -> str:
  """One row per claim, each drawn from its results file, with links."""
  load = lambda bench: results.load(bench, results_dir)['result']
  rows = []
  demo = load('demo')
  rows.append([
      'Main job (`make demo`): 2-digit addition, warm start then GRPO',
      f"greedy accuracy {_acc(demo['greedy_before_rl'])} ->"
      f" **{_acc(demo['greedy_after_rl'])}**; micro-step max/mean load"
      f" {_f(demo['microstep_max_over_mean'])} (static EP"
      f" {_f(demo['microstep_max_over_mean_static'])})",
      _link('Main job', 'demo')])
  data = load('demo_dataset')
  rows.append([
      'Dataset demo (`make demo-dataset`): word problems, BPE, math-verify',
      f"greedy accuracy {_acc(data['greedy_before_rl'])} ->"
      f" **{_acc(data['greedy_after_rl'])}**",
      _link('Main job', 'demo_dataset')])
  rl = load('bench_rl_step')
  rows.append([
      'RL step end to end, 8 simulated CPU devices, every cost counted',
      f"ForeMoE **{_f(rl['speedup_step_vs_static'])}x** vs static EP,"
      f" {_f(rl['speedup_step_vs_eplb_step'])}x vs step-level EPLB",
      _link('RL step end to end', 'bench_rl_step')])
  summ = load('simulate_cluster')['summary']
  val = load('simulate_cluster')['validation']
  worst = (None if val is None else
           max(val['max_rel_error_update'], val['max_rel_error_recompute']))
  rows.append([
      'Predicted: Qwen3-30B-A3B on 64 H100s (simulator validated on this'
      ' CPU)',
      f"**{_f(summ['speedup_64gpu_foremoe_vs_static'])}x** vs static EP,"
      f" {_f(summ['speedup_64gpu_foremoe_vs_eplb_step'])}x vs step-level"
      f" EPLB (paper: up to {_f(summ['paper_speedup_64gpu'])}x)"
      + ('' if worst is None else
         f"; validation error at most {100 * worst:.0f}%"),
      _link('Scale-out simulator', 'simulate_cluster')])
  pl = load('bench_planner')
  worst_fm = max(c['methods']['foremoe']['mean_max_over_mean']
                 for c in pl['configs'])
  worst_trained = max((c['methods']['foremoe_constrained']['mean_max_over_mean']
                       for c in pl['configs']
                       if 'foremoe_constrained' in c['methods']), default=None)
  rows.append([
      f"Planner balance, {len(pl['configs'])} configurations (synthetic and"
      " sampled traces)",
      f"ForeMoE max/mean at most {_f(worst_fm, 4)}; targets met:"
      f" {_f(pl['all_targets_met'])}"
      + ('' if 'all_targets_met_constrained' not in pl else
         f"; under the trainer's transfer budget at most"
         f" {_f(worst_trained, 4)}, targets met:"
         f" {_f(pl['all_targets_met_constrained'])}")
      + ('' if pl.get('milp_gap') is None else
         f"; {_f(100 * pl['milp_gap'], 2)}% from the exact MILP"),
      _link('Planner', 'bench_planner')])
  moe = load('bench_moe_layer')
  rows.append([
      'Expert-parallel layer, balanced vs static placement',
      f"forward {_f(moe['speedup'])}x (exact dispatch)",
      _link('Expert-parallel layer', 'bench_moe_layer')])
  msa = load('bench_msa')
  pre, dec = msa['results'][-1], (msa.get('decode') or [None])[-1]
  rows.append([
      'MSA on CPU vs flash-style causal dense',
      f"prefill **{_f(pre['speedup_vs_causal_dense'])}x** at"
      f" {_f(pre['seq_len'])} tokens"
      + ('' if dec is None else
         f"; decode {_f(dec['speedup'])}x at a {_f(dec['cache_len'])} cache"),
      _link('MSA', 'bench_msa')])
  gpu_path = os.path.join(results_dir, 'gpu_check_h100.json')
  if os.path.exists(gpu_path):
    with open(gpu_path) as f:
      gpu = json.load(f)
    by_len = lambda rows, key: {r.get(key): r for r in rows or []}
    pre = by_len(gpu['bench_msa'].get('results'), 'seq_len')
    dec = by_len(gpu['bench_msa'].get('decode'), 'cache_len')
    cell = lambda row, key: _f(row.get(key)) if row else '-'
    rows.append([
        'MSA on one H100 vs cuDNN dense, bf16 (`make gpu-check`)',
        f"prefill {cell(pre.get(32768), 'speedup')}x at 32k,"
        f" **{cell(pre.get(131072), 'speedup')}x** at 128k; decode"
        f" {cell(dec.get(131072), 'decode_speedup')}x at 128k (batch 8);"
        f" fwd+bwd {cell(pre.get(32768), 'train_speedup_main_only')}x at"
        f" 32k (main branch)",
        f'[On one NVIDIA GPU]({_DETAILS}#on-one-nvidia-gpu),'
        f' [`gpu_check_h100.json`](results/gpu_check_h100.json)'])
  static = load('gpu_static')
  summ = static['summary']
  main = next(r for r in static['rows'] if r['site'] == 'main')
  rows.append([
      'MSA kernels compiled for an H100 on this host, no GPU',
      f"{summ['kernels']} kernels, {len(summ['over_shared_memory'])} over"
      f" shared memory (largest {summ['max_shared_bytes'] / 1024:.1f} of"
      f" 227 KiB); {len(summ['spilling'])} spill registers; the forward:"
      f" {main['registers']} registers,"
      f" {main['occupancy']['blocks_per_sm']} block"
      f"{'' if main['occupancy']['blocks_per_sm'] == 1 else 's'} of"
      f" {main['num_warps']} warps per SM",
      f'[Static GPU check]({_DETAILS}#static-gpu-check-no-gpu-needed),'
      f' [`gpu_static.json`](results/gpu_static.json)'])
  rehearsal = load('gpu_rehearsal')
  outcomes = collections.Counter(
      t['outcome'] for t in rehearsal['tests'].values())
  summ = rehearsal['summary']
  rows.append([
      'The `gpu` tests rehearsed on this host, no GPU (`make gpu-rehearsal`)',
      f"{_f(outcomes['passed'])} of {_f(len(rehearsal['tests']))} passed"
      f" with the Triton kernels' own code in interpret mode;"
      f" {_f(summ['recorded'])} kernels compiled for an H100 at the tests'"
      f" shapes, {len(summ['errors'])} refused,"
      f" {len(summ['over_shared_memory'])} over shared memory",
      f'[GPU rehearsal]({_DETAILS}#gpu-rehearsal-no-gpu-needed),'
      f' [`gpu_rehearsal.json`](results/gpu_rehearsal.json)'])
  calls = load('gpu_launches')['calls']
  launch = lambda name: _f(calls[name]['summary']['launches'])
  moe = calls['moe layer x8, ragged_dot']['summary']
  gmm = calls['moe layer x8, pallas']['summary']
  rows.append([
      'What an H100 launches (XLA compiled on this host)',
      f"MSA decode 128k x8: {launch('decode 128k x8')} launches (cuDNN"
      f" dense {launch('decode 128k x8, dense')}); 32k training step:"
      f" {launch('train 32k, kv_outer')} (KV-outer),"
      f" {launch('train 32k, tiles')} (union tiles), no host syncs. MoE"
      f" layer on 8 GPUs, forward and backward: `ragged_dot` is dense GEMMs"
      f" over all groups ({_bytes(moe['kernel_bytes'])} in GEMMs,"
      f" {_bytes(moe['glue_bytes'])} of glue); the Triton grouped matmul"
      f" (now the GPU default) {_bytes(gmm['kernel_bytes'])} and"
      f" {_bytes(gmm['glue_bytes'])}",
      f'[What an H100 launches]({_DETAILS}#what-an-h100-launches-no-gpu-'
      f'needed), [`gpu_launches.json`](results/gpu_launches.json)'])
  mfd = load('msa_from_dense')
  q = mfd['budgets'][0]
  rows.append([
      'MSA from a dense checkpoint: q/k init, indexer distillation, switch',
      f"{100 * q['blocks_kept_frac']:.0f}% of blocks: recall"
      f" {_f(q['recall_init'])} -> **{_f(q['recall_distilled'])}** (far"
      f" queries {_f(q['recall_far_init'])} ->"
      f" {_f(q['recall_far_distilled'])} of at most"
      f" {_f(q['recall_far_oracle'])}); greedy accuracy"
      f" {_acc(q['acc_msa_distilled'])} at the switch,"
      f" **{_acc(mfd['acc_msa_after_adapt'])}** after"
      f" {mfd['adapt_steps']} sparse steps (dense {_acc(mfd['acc_dense'])})",
      _link('MSA from a dense checkpoint', 'msa_from_dense')])
  smp = load('bench_sampler')
  rows.append([
      'Sampler: KV cache and the routing record',
      f"{_f(smp['speedup'])}x vs recomputing the prefix per token; the"
      " record costs"
      f" {_f(100 * smp['routing_record_overhead'], 2)}% of decode",
      _link('Sampler', 'bench_sampler')])
  mem = load('memory_report')
  rows.append([
      'Memory: Qwen3-30B-A3B update, EP 64',
      f"{_bytes(mem['peak_bytes_per_device'])} per device; fits an 80 GB"
      f" H100: {_f(mem['fits_80gb_with_10pct_headroom'])}",
      _link('Memory', 'memory_report')])
  soak = load('soak')
  rows.append([
      f"Soak: {soak['steps']} RL steps, memory trend",
      f"RSS {100 * soak['rss_growth_per_1k_steps']:+.2f}% per 1,000 steps"
      f" (p {soak['rss']['p_value']:.1e}; target"
      f" {'met' if soak['target_met'] else 'not met'}), device buffers"
      f" {100 * soak['device_bytes_growth']:+.2f}%",
      _link('Soak', 'soak')])
  return '\n'.join([
      '<!-- generated by `python -m experiments.render_results` from'
      ' results/*.json: do not edit by hand -->',
      "CPU rows: this repository's 2-core host with 8 simulated devices;"
      " each file names its command, machine and versions"
      f" ({_DETAILS} shows them above each table).", '',
      _table(['what', 'result', 'details'], rows), ''])


RENDERERS = {
    'bench_rl_step': render_rl_step,
    'bench_moe_layer': render_moe_layer,
    'bench_planner': render_planner,
    'bench_msa': render_msa,
    'bench_sampler': render_sampler,
    'profile_rl_step': render_profile_rl_step,
    'msa_from_dense': render_msa_from_dense,
    'simulate_cluster': render_simulate_cluster,
    'simulate_cluster.validation': render_simulate_cluster_validation,
    'sweep_moves': render_sweep_moves,
    'soak': render_soak,
    'bench_rewards': render_rewards,
    'memory_report': render_memory_report,
    'gpu_static': render_gpu_static,
    'gpu_rehearsal': render_gpu_rehearsal,
    'gpu_launches': render_gpu_launches,
    'demo': render_demo,
    'demo_dataset': render_demo,
}

# Blocks drawn from several results files: name -> render(results_dir).
COMPOSITES = {
    'headline': render_headline,
}


def render_block(bench: str, results_dir: str = results.DEFAULT_DIR) -> str:
  if bench in COMPOSITES:
    return COMPOSITES[bench](results_dir)
  if bench.startswith('gpu_check'):
    return (f'<!-- generated by `python -m experiments.render_results` from '
            f'results/{bench}.json: do not edit by hand -->\n'
            f'{render_gpu_check(results_dir, bench)}\n')
  if bench not in RENDERERS:
    raise KeyError(f'a file names results:{bench}, which has no renderer; '
                   f'known: {sorted([*RENDERERS, *COMPOSITES])}.')
  # `<bench>.<part>` renders one part of results/<bench>.json.
  record = results.load(bench.split('.')[0], results_dir)
  return (f'<!-- generated by `python -m experiments.render_results` from '
          f'results/{record["bench"]}.json: do not edit by hand -->\n'
          f'{provenance(record)}\n\n{RENDERERS[bench](record["result"])}\n')


def render(text: str, results_dir: str = results.DEFAULT_DIR) -> str:
  """`text` with every results block rebuilt from its file(s)."""
  return BLOCK_RE.sub(
      lambda m: m.group(1) + render_block(m.group('bench'), results_dir)
      + m.group(4), text)


def benches_in(text: str) -> list[str]:
  return [m.group('bench') for m in BLOCK_RE.finditer(text)]


def main(argv):
  del argv
  stale = []
  for path in _FILES.value:
    with open(path) as f:
      text = f.read()
    new = render(text, _RESULTS_DIR.value)
    names = benches_in(text)
    if _CHECK.value:
      if new != text:
        sys.stdout.writelines(difflib.unified_diff(
            text.splitlines(True), new.splitlines(True), path, 'rendered'))
        stale.append(path)
      continue
    if new != text:
      tmp = path + '.tmp'
      with open(tmp, 'w') as f:
        f.write(new)
      os.replace(tmp, path)
    print(f'rendered {len(names)} blocks into {path}: {names}')
  if stale:
    print(f'\n{", ".join(stale)} do(es) not match {_RESULTS_DIR.value}/; run '
          '`python -m experiments.render_results`.')
    sys.exit(1)
  if _CHECK.value:
    print(f'{", ".join(_FILES.value)} match {_RESULTS_DIR.value}/.')


if __name__ == '__main__':
  app.run(main)
