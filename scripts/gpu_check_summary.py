"""One JSON line for `make gpu-check`: the run's setup, test counts, benches.

Reads the pytest junit XML and the last JSON line of each bench log (the
MSA bench; the grouped-GEMM bench, when it had time to run), prints one
JSON object and writes it to --out. Exits non-zero when a gpu test failed,
the MSA bench did not finish, or the grouped-GEMM bench ran and failed,
so `make gpu-check` fails too.
"""
import argparse
from importlib import metadata
import json
import sys
import xml.etree.ElementTree as ET

sys.path.insert(0, '.')
from foremoe_jax.utils.run_info import run_info  # pylint: disable=g-import-not-at-top

ROW = '# row '  # benchmark_gpu.run's per-phase lines
PACKAGES = ('jax', 'jaxlib', 'jax-cuda13-plugin', 'jax-cuda13-pjrt',
            'jax-cuda12-plugin', 'jax-cuda12-pjrt', 'flax', 'optax',
            'orbax-checkpoint', 'chex', 'nvidia-cudnn-cu13', 'triton')


def _tests(path):
  try:
    root = ET.parse(path).getroot()
  except (OSError, ET.ParseError) as e:
    return {'error': f'no junit report: {e}'}
  counts = {'passed': 0, 'failed': 0, 'skipped': 0}
  failed = []
  for case in root.iter('testcase'):
    name = f"{case.get('classname')}::{case.get('name')}"
    if case.find('failure') is not None or case.find('error') is not None:
      counts['failed'] += 1
      failed.append(name)
    elif case.find('skipped') is not None:
      counts['skipped'] += 1
    else:
      counts['passed'] += 1
  return {**counts, 'failed_tests': failed}


def _bench(path):
  try:
    lines = open(path).read().splitlines()
  except OSError as e:
    return {'error': str(e)}
  for line in reversed(lines):
    if line.startswith('{'):
      try:
        return json.loads(line)
      except json.JSONDecodeError:
        break
  # Cut short (a time limit): keep the rows it printed as it went.
  rows = [json.loads(line[len(ROW):]) for line in lines
          if line.startswith(ROW)]
  return {'error': 'no final JSON line in the bench log', 'partial': rows}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--junit', required=True)
  ap.add_argument('--bench_log', required=True)
  ap.add_argument('--tests_rc', type=int, required=True)
  ap.add_argument('--bench_rc', type=int, required=True)
  ap.add_argument('--out', required=True)
  ap.add_argument('--gemm_log', default=None)
  ap.add_argument('--gemm_rc', type=int, default=None,
                  help='absent: the grouped-GEMM bench did not run')
  a = ap.parse_args()
  info = run_info()
  info['packages'] = {}
  for name in PACKAGES:
    try:
      info['packages'][name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      pass
  tests, bench = _tests(a.junit), _bench(a.bench_log)
  # A bench cut by its soft deadline still returns, but is not a pass.
  ok = (a.tests_rc == 0 and a.bench_rc == 0 and not tests.get('failed')
        and 'error' not in bench and bench.get('complete', False)
        and tests.get('passed', 0) > 0)
  gemm = None
  if a.gemm_rc is not None:
    gemm = _bench(a.gemm_log)
    gemm.pop('partial', None)
    ok = ok and a.gemm_rc == 0 and gemm.get('complete', False)
  elif a.gemm_log:
    try:
      gemm = {'skipped': open(a.gemm_log).read().strip()}
    except OSError:
      pass
  summary = {'gpu_check': 'pass' if ok else 'fail', 'setup': info,
             'tests': tests, 'tests_rc': a.tests_rc, 'bench_rc': a.bench_rc,
             'bench_msa': bench, 'gemm_rc': a.gemm_rc,
             'bench_grouped_gemm': gemm}
  with open(a.out, 'w') as f:
    json.dump(summary, f, indent=1)
    f.write('\n')
  print(json.dumps(summary))
  sys.exit(0 if ok else 1)


if __name__ == '__main__':
  main()
