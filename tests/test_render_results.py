"""The generated results blocks (README.md, docs/results.md) are exactly
what results/*.json say."""
import json
import os
import re

import pytest

from experiments import render_results
from foremoe_jax.utils import results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_docs_match_the_results_files():
  names = set()
  for path in render_results.DEFAULT_FILES:
    with open(os.path.join(ROOT, path)) as f:
      text = f.read()
    in_file = render_results.benches_in(text)
    assert len(in_file) == len(set(in_file)), f'{path}: a block twice'
    names |= set(in_file)
    rendered = render_results.render(text, os.path.join(ROOT, 'results'))
    assert rendered == text, (
        f'{path} is stale: run `python -m experiments.render_results`.')
  # Every renderer has its block in one of the files; the gpu-check
  # summaries (results/gpu_check*.json) render by file name.
  gpu = {n for n in names if n.startswith('gpu_check')}
  assert names - gpu == {*render_results.RENDERERS,
                         *render_results.COMPOSITES}
  assert gpu == {f[:-5] for f in os.listdir(os.path.join(ROOT, 'results'))
                 if f.startswith('gpu_check') and f.endswith('.json')}


def _github_anchor(heading: str) -> str:
  """The anchor GitHub gives a Markdown heading: lower case, punctuation
  other than '-' dropped, spaces to '-'."""
  kept = ''.join(ch for ch in heading.strip().lower()
                 if ch.isalnum() or ch in ' -_')
  return kept.replace(' ', '-')


def test_readme_links_land_on_sections_and_files():
  with open(os.path.join(ROOT, 'README.md')) as f:
    readme = f.read()
  with open(os.path.join(ROOT, 'docs', 'results.md')) as f:
    anchors = {_github_anchor(line.lstrip('#'))
               for line in f if line.startswith('## ')}
  links = re.findall(r'\]\(([^)#\s]+)(?:#([\w-]+))?\)', readme)
  assert any(a for _, a in links), 'the README links no results section'
  for target, anchor in links:
    assert os.path.exists(os.path.join(ROOT, target)), target
    if anchor:
      assert target == 'docs/results.md' and anchor in anchors, (
          f'{target}#{anchor}: no such section; have {sorted(anchors)}')


def test_each_results_file_names_its_command_and_machine():
  for bench in {name.split('.')[0] for name in render_results.RENDERERS}:
    record = results.load(bench, os.path.join(ROOT, 'results'))
    assert record['bench'] == bench
    assert record['command'].startswith(('python -m experiments.',
                                         'make '))
    assert {'python', 'cpu_count', 'numpy'} <= set(record['run'])


def _sampler_result(speedup):
  return dict(batch=64, new_tokens=256, cached_tok_s=1000.0 * speedup,
              cached_no_record_tok_s=1030.0 * speedup,
              recompute_prefix_tok_s=1000.0, prefix_bucket=16,
              recompute_tok_s=500.0, speedup=speedup,
              speedup_vs_whole_buffer=2 * speedup, recompute_agreement=1.0,
              recompute_prefix_agreement=1.0, routing_record_overhead=0.037,
              routing_record_bytes=67000, routing_record_dtype='int8',
              target_speedup=5.0, target_overhead=0.1)


def test_render_replaces_only_inside_the_markers(tmp_path):
  argv = ['experiments/bench_sampler.py', '--json']
  results.save('bench_sampler', {'python': '3.x', 'cpu_count': 2},
               _sampler_result(40.0), results_dir=str(tmp_path), argv=argv)
  text = ('intro 1.0\n<!-- results:bench_sampler -->\nold 99x\n'
          '<!-- /results:bench_sampler -->\noutro 2.0\n')
  out = render_results.render(text, str(tmp_path))
  assert out.startswith('intro 1.0\n<!-- results:bench_sampler -->\n')
  assert out.endswith('<!-- /results:bench_sampler -->\noutro 2.0\n')
  assert 'old 99x' not in out and '**40.0x**' in out
  assert '`python -m experiments.bench_sampler --json`' in out
  # Idempotent, and a new result changes the block.
  assert render_results.render(out, str(tmp_path)) == out
  results.save('bench_sampler', {'python': '3.x', 'cpu_count': 2},
               _sampler_result(12.5), results_dir=str(tmp_path), argv=argv)
  assert '**12.5x**' in render_results.render(out, str(tmp_path))


def test_missing_file_and_unknown_bench_fail_clearly(tmp_path):
  text = '<!-- results:bench_sampler -->\n<!-- /results:bench_sampler -->\n'
  with pytest.raises(FileNotFoundError, match='experiments.bench_sampler'):
    render_results.render(text, str(tmp_path))
  with pytest.raises(KeyError, match='no renderer'):
    render_results.render(text.replace('sampler', 'nope'), str(tmp_path))
  (tmp_path / 'bench_sampler.json').write_text(json.dumps({'result': {}}))
  with pytest.raises(ValueError, match='not written by'):
    render_results.render(text, str(tmp_path))


def test_save_writes_atomically_and_can_be_turned_off(tmp_path):
  assert results.save('x', {}, {'a': 1}, results_dir='') is None
  path = results.save('x', {'cpu_count': 2}, {'a': 1},
                      results_dir=str(tmp_path), argv=['prog.py'])
  assert os.listdir(tmp_path) == ['x.json']
  assert json.load(open(path))['result'] == {'a': 1}


def test_save_keeps_numpy_numbers_as_numbers(tmp_path):
  import numpy as np  # pylint: disable=g-import-not-at-top
  path = results.save('x', {}, {'a': np.float32(1.5), 'b': np.arange(3),
                                'c': np.int64(7)}, results_dir=str(tmp_path))
  assert json.load(open(path))['result'] == {'a': 1.5, 'b': [0, 1, 2], 'c': 7}


def test_planner_alt_rows_group_by_shape_and_slots():
  """The alt-trace summary by hand: two rows of one shape and slot count,
  one meeting the target in training and both missing it alone."""
  row = lambda name, con, free, ok, copies: dict(
      name=name, redundant_slots_per_device=1, target_max_over_mean=1.08,
      meets_target_constrained=ok, meets_target=False,
      methods={m: {'mean_max_over_mean': v,
                   'copies_per_device_per_microstep_per_layer': c * copies}
               for m, v, c in [('foremoe_constrained', con, 1),
                               ('foremoe', free, 1),
                               ('eplb_step', 1.5, 4),
                               ('eplb_microstep', 1.0, 16)]})
  text = render_results.render_planner_alt(dict(
      alt_configs=[row('alt_zipf1.0_c3_E64_D8_top2_r1', 1.06, 1.10, True, 0.5),
                   row('alt_zipf0.6_c30_E64_D8_top2_r1', 1.12, 1.20, False,
                       0.75)],
      alt_all_targets_met=False, alt_all_targets_met_constrained=False))
  assert ('| E64_D8_top2 | 1 | 1.08 | 1 / 2 | 1.090 (1.120) | 0 / 2 |'
          ' 1.150 (1.200) | 1.500 | 1.000 |') in text
  assert 'All met: in training no, ForeMoE alone no.' in text
  # Copies averaged over the rows: (0.5 + 0.75) / 2, x4, x16.
  assert 'in training 0.625, EPLB step 2.50.' in text
  assert '(10.0 copies)' in text


def test_rl_step_shows_the_spread_of_its_repetitions():
  with open(os.path.join(ROOT, 'results', 'bench_rl_step.json')) as f:
    res = json.load(f)['result']
  res = dict(res, speedup_step_per_repetition={
      'static': [1.8184, 1.5554, 1.7052], 'eplb_step': [1.1662, 1.1177, 1.1432],
      'foresight_split': [1.0179, 0.9687, 0.9368]})
  text = render_results.render_rl_step(res)
  assert ('Within each of the 3 repetitions (the methods back to back),'
          ' whole step: 1.56-1.82x vs static EP, 1.12-1.17x vs step-level'
          ' EPLB, 0.937-1.02x vs foresight split.') in text
  # An older results file (no per-repetition ratios) renders without it.
  res.pop('speedup_step_per_repetition')
  assert 'Within each' not in render_results.render_rl_step(res)


def test_recorded_command_leaves_out_where_the_file_went():
  argv = ['/x/experiments/bench_rl_step.py', '--json', '--results_dir=/tmp/a',
          '--repeats', '5', '--results_dir', '/tmp/b', '--prompts=64']
  assert results.command_line(argv) == (
      'python -m experiments.bench_rl_step --json --repeats 5 --prompts=64')
