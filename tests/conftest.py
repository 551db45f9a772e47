"""Test-wide set-up: 8 simulated CPU devices, set once before jax loads.

Tests marked `gpu` need a CUDA device and run only through
`make gpu-check` (scripts/gpu_check.sh sets JAX_PLATFORMS=cuda, which the
setdefault below leaves alone); anywhere else they are skipped with the
reason, so the CPU suite stays green.

Under pytest-xdist (`make test` runs `-n 2`), the default 'load' schedule
is replaced by whole files per worker, the slowest first: a file's tests
run in one process, so its module-scoped fixtures (a rollout, a trained
step) are built once and its tests reuse each other's compiled programs,
instead of both workers building them; and starting the long files first
leaves short ones to even out the end. file_seconds.json holds each file's
seconds from a `pytest -n 2` run (only their order matters; a file not
listed counts as slowest, so a new long file never starts last). An
explicit `--dist` other than 'load' is left alone.
"""
import atexit
from importlib import metadata
import json
import os
import shutil
import tempfile
import time

import pytest

import gpu_rehearsal

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

# XLA:CPU's LLVM optimisation level for the suite's programs, unless the
# caller chose one. The suite is bound by compiling (tiny models, a few
# steps each): at level 0 the compiles run about a third faster and the
# programs a few times slower, which measured 16-25% off whole test files
# (tests/rl/test_step.py, tests/model/*). Numbers the suite compares are
# computed under the same flags on both sides. Benchmarks never run with
# it. Test subprocesses inherit it with os.environ; tests that set their
# own XLA_FLAGS add `CPU_TEST_XLA_FLAGS`.
CPU_TEST_XLA_FLAGS = '--xla_backend_optimization_level=0'


def _jaxlib_before(major: int, minor: int) -> bool:
  try:
    version = metadata.version('jaxlib').split('.')
    return tuple(int(v) for v in version[:2]) < (major, minor)
  except (metadata.PackageNotFoundError, ValueError):
    return False


# jaxlib 0.10's XLA:CPU emits its fusions through the MLIR fusion
# emitters by default; its older LLVM IR emitters compile the suite's
# programs about a third faster (the tiny MSA model's loss and gradient:
# 4.3 s -> 2.8 s to compile, the same 0.3 s to run; tests/rl/test_step.py
# with tests/model/test_remat.py: 218 s -> 170 s). jaxlib 0.11 dropped the
# flag, and XLA aborts on a flag it does not know, hence the version test.
#
# XLA:CPU also splits each program's LLVM module into parts it compiles on
# threads of their own. The suite runs two workers on two cores, so the
# threads only contend: one part took 8-11% less CPU (tests/model/
# test_transformer.py, test_remat.py with rl/test_update_numerics.py,
# paired runs); named for the jaxlib it was measured on, as above.
if _jaxlib_before(0, 11):
  CPU_TEST_XLA_FLAGS += (' --xla_cpu_use_fusion_emitters=false'
                         ' --xla_cpu_parallel_codegen_split_count=1')
# Subprocesses that run a job for many steps (tests/rl/test_exact_resume.py
# runs rl_train twice, the second on the first's compiled programs) are
# bound by running, not compiling: at level 1 a tiny RL step ran 4-5x
# faster than at 0 and compiled about as fast, with the same numbers (the
# run's metrics were equal), 45% less CPU over one cold and one warm run.
# Compile-bound test files took 1.5-1.8x longer at level 1, so the suite
# itself keeps level 0.
CPU_RUN_XLA_FLAGS = CPU_TEST_XLA_FLAGS.replace(
    'optimization_level=0', 'optimization_level=1')


def cpu_run_env(root: str) -> dict:
  """The environment of such a subprocess: this one's (the run's
  compilation cache included), the repository `root` on the path, 8
  devices and CPU_RUN_XLA_FLAGS."""
  return dict(os.environ, PYTHONPATH=root,
              XLA_FLAGS='--xla_force_host_platform_device_count=8 '
              + CPU_RUN_XLA_FLAGS)


# configs/tiny.py's job as several tests run it at the suite's XLA flags:
# tests/test_entry_points.py's preempted run, test_soak's job, and the
# in-process trainer runs of tests/rl/test_nonfinite.py and
# test_resume_tail.py. The same settings make the same programs, which the
# run's compilation cache (below) compiles once for all of them. One
# capacity and one pair bucket: every step runs one update program.
SHARED_TINY_RUN = {'task': 'sort', 'rl.prompts_per_step': 8,
                   'planner.method': 'eplb_step',
                   'parallel.capacity_factors': (100,),
                   'parallel.cell_factors': (100,)}


def shared_tiny_run_flags() -> list[str]:
  """SHARED_TINY_RUN as an entry point's --config.* flags."""
  return [f'--config.{k}={v}' for k, v in SHARED_TINY_RUN.items()]


def apply_shared_tiny_run(cfg):
  """SHARED_TINY_RUN set on a configs/tiny.py ConfigDict, in place."""
  cfg.update_from_flattened_dict(SHARED_TINY_RUN)
  return cfg


if (os.environ['JAX_PLATFORMS'] == 'cpu'
    and 'xla_backend_optimization_level' not in os.environ['XLA_FLAGS']):
  os.environ['XLA_FLAGS'] += ' ' + CPU_TEST_XLA_FLAGS


def _share_a_compilation_cache():
  """One persistent compilation cache for the whole run, made fresh for it.

  Most of the suite's time is XLA compiling small programs, and many tests
  build the same ones (the tiny model's step under another test's name, the
  entry points' subprocesses): with the cache, each is compiled once. The
  process that loads this first (pytest's controller) makes the folder and
  removes it at exit; xdist's workers and the tests' subprocesses inherit
  it through the environment (tests that run entry points pass
  `os.environ` on). A cache the caller set is left alone. Every program is
  cached, however quick its compile.
  """
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '-1')
  if 'JAX_COMPILATION_CACHE_DIR' in os.environ:
    return
  cache_dir = tempfile.mkdtemp(prefix='foremoe_test_jax_cache_')
  os.environ['JAX_COMPILATION_CACHE_DIR'] = cache_dir
  # The triton package's kernel cache (tests/msa/test_msa_gpu_static.py)
  # goes there too, not to ~/.triton: a run leaves nothing behind.
  os.environ.setdefault('TRITON_CACHE_DIR', os.path.join(cache_dir, 'triton'))
  atexit.register(shutil.rmtree, cache_dir, ignore_errors=True)


_share_a_compilation_cache()

_FILE_SECONDS = os.path.join(os.path.dirname(__file__), 'file_seconds.json')


def _gpu_missing_reason():
  if gpu_rehearsal.active():
    return None
  import jax  # pylint: disable=g-import-not-at-top
  try:
    if jax.default_backend() == 'gpu':
      return None
  except RuntimeError:
    pass
  return ('needs an NVIDIA GPU: run `make gpu-check` (JAX_PLATFORMS=cuda); '
          f'this process has JAX_PLATFORMS={os.environ.get("JAX_PLATFORMS")!r}')


def _slowest_files_first(items):
  """Sorts in place by the file's recorded seconds, descending; the order
  within a file is kept (a stable sort)."""
  with open(_FILE_SECONDS) as f:
    seconds = json.load(f)
  items.sort(key=lambda item: -seconds.get(item.nodeid.split('::', 1)[0],
                                           float('inf')))


def pytest_configure(config):
  # `make gpu-rehearsal`: the gpu tests on this host (tests/gpu_rehearsal.py).
  gpu_rehearsal.pytest_configure(config)


def pytest_collection_modifyitems(config, items):
  del config
  _slowest_files_first(items)
  gpu_items = [item for item in items if item.get_closest_marker('gpu')]
  if not gpu_items:
    return
  reason = _gpu_missing_reason()
  if reason:
    for item in gpu_items:
      item.add_marker(pytest.mark.skip(reason=reason))


def pytest_runtest_setup(item):
  """A run with a time budget (FOREMOE_TEST_DEADLINE, epoch seconds; set by
  scripts/gpu_check.sh) skips the tests it has no time left to start, so
  pytest still finishes and writes its report."""
  del item
  deadline = os.environ.get('FOREMOE_TEST_DEADLINE')
  if deadline and time.time() > float(deadline):
    pytest.skip('the time budget of this run is spent '
                '(FOREMOE_TEST_DEADLINE)')


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  """Whole files per worker, in collection order (slowest first)."""
  if config.getvalue('dist') != 'load':
    return None
  from xdist.scheduler import LoadFileScheduling  # pylint: disable=g-import-not-at-top
  config.option.loadscopereorder = False  # Keep the order sorted above.
  return LoadFileScheduling(config, log)


@pytest.fixture
def gpu_choices(monkeypatch):
  """What a GPU backend picks when nothing is named (the defaults read
  jax.default_backend(), which is 'cpu' here): the ragged exchanges, the
  Pallas grouped GEMM and the Pallas Triton MSA kernels, for tests that
  trace or lower the GPU path on this host."""
  # pylint: disable=g-import-not-at-top
  from foremoe_jax.model import dispatch_exact, grouped_swiglu
  from pallas_kernels.msa import api as msa_api
  monkeypatch.setattr(dispatch_exact, 'default_exchange',
                      lambda backend=None: 'ragged')
  monkeypatch.setattr(grouped_swiglu, 'default_kind',
                      lambda backend=None: 'pallas')
  monkeypatch.setattr(msa_api, 'resolve_impl', lambda impl, pallas_backend=None: (
      'pallas' if impl == 'auto' else impl, 'gpu', False))
  # From jax 0.11 the Triton lowering asks the device for its compute
  # capability. The public way to name one with no GPU (an abstract mesh
  # with a GPU device) clashes with the step's own shard_map mesh, so the
  # H100 is named through jax's GPU table.
  from pallas_kernels.msa import gpu_static  # pylint: disable=g-import-not-at-top
  with gpu_static.h100_gpu_table():
    yield
