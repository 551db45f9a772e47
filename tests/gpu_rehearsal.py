"""The `gpu` tests rehearsed on a host with no GPU (`make gpu-rehearsal`).

A GPU is lent for minutes, once in a while: a kernel that cannot launch
there, or a test whose own logic is wrong, wastes the one run. This pytest
plugin (loaded by tests/conftest.py when FOREMOE_GPU_REHEARSAL=1) runs the
tests marked `gpu` here, and every pallas_call they make for the GPU
(interpret=False: the Triton kernels) is

  1. run in interpret mode, so the test's own checks against its reference
     run on the kernel's logic, at the test's shapes and dtypes;
  2. recorded as XLA:CPU lowers it: after vmap, autodiff and shard_map, so
     at the very shapes, dtypes and grid the GPU would launch;
  3. at the end, lowered for CUDA and compiled by Triton for an H100
     (sm_90a) with pallas_kernels/msa/gpu_static.py: shared memory,
     registers, spills, tensor-core instructions. A kernel Triton cannot
     compile, or one over the 227 KiB of shared memory a block may have,
     fails the rehearsal (its `gpu_static` summary), as it would fail on
     the GPU.

The code a GPU picks by platform picks it here too: `lax.platform_dependent`
takes its `cuda` branch (the grouped matmul's kernels), the MoE layer's
grouped GEMM default is the Triton one and MSA's 'auto' is the Pallas GPU
path. What stays the CPU's: the expert exchange (XLA:CPU has no ragged
all-to-all; the emulation runs), cuDNN (the dense baselines run in XLA),
and everything a CPU cannot show: timing, TF32 and bf16 tensor-core
rounding, races between programs.

The report (each test's outcome and kernel launches; a compile row per
distinct kernel, with the tests that launched it) goes to
gpu_rehearsal.json in $FOREMOE_GPU_REHEARSAL_DIR (results/).
"""
import functools
import hashlib
import os
import time

import pytest

ENV = 'FOREMOE_GPU_REHEARSAL'
DIR_ENV = 'FOREMOE_GPU_REHEARSAL_DIR'
_NAME = 'gpu_rehearsal_session'


def active() -> bool:
  return os.environ.get(ENV) == '1'


def pytest_configure(config):
  """Registers the rehearsal when FOREMOE_GPU_REHEARSAL=1 (tests/conftest.py
  calls this; `pytest -p gpu_rehearsal` loads it for other test trees)."""
  if active() and not config.pluginmanager.has_plugin(_NAME):
    plugin = Rehearsal()
    plugin.install()
    config.pluginmanager.register(plugin, _NAME)


def platform() -> str:
  """The platform a `gpu` test runs on: 'gpu' in a rehearsal too."""
  if active():
    return 'gpu'
  import jax  # pylint: disable=g-import-not-at-top
  return jax.devices()[0].platform


def _invariant(aval):
  """aval with no varying manual axes (jax 0.11: its manual_axis_type;
  0.10: its vma)."""
  from jax._src import core  # pylint: disable=g-import-not-at-top
  mat = getattr(aval, 'manual_axis_type', None)
  if mat is not None:
    return aval if mat.empty else aval.update(manual_axis_type=core.empty_mat)
  return aval.update(vma=frozenset()) if getattr(aval, 'vma', None) else aval


def _cpu_precisions(jaxpr):
  """The kernel's jaxpr with the dots XLA:CPU cannot take (the GPU's
  TF32 algorithms: the f32 kernels ask for TF32x3) at Precision.HIGHEST,
  full f32 products: what TF32x3 approximates to about 1e-6."""
  from jax import lax  # pylint: disable=g-import-not-at-top
  from jax._src import core  # pylint: disable=g-import-not-at-top

  def walk(obj):
    if isinstance(obj, core.Jaxpr):
      return obj.replace(eqns=[eqn(e) for e in obj.eqns])
    if isinstance(obj, core.ClosedJaxpr):
      return obj.replace(jaxpr=walk(obj.jaxpr))
    if isinstance(obj, tuple):
      return tuple(walk(o) for o in obj)
    return obj

  def eqn(e):
    params = {k: walk(v) for k, v in e.params.items()}
    if e.primitive.name == 'dot_general' and 'TF32' in str(
        params.get('precision')):
      params['precision'] = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
    return e.replace(params=params)

  return walk(jaxpr)


class Rehearsal:
  """The plugin: installs the lowering rule at configure time, labels what
  each test launches, compiles it all at the end of the session."""

  def __init__(self):
    self.current = '(outside a test)'
    # key -> {'label', 'fn', 'args', 'tests'}: one entry per distinct
    # (kernel, shapes, params) as the CPU lowers it.
    self.kernels: dict = {}
    self.per_test: dict[str, int] = {}
    self.outcomes: dict[str, str] = {}
    self.summary = None  # gpu_static's summary, once compile_all has run.
    self._undo = []

  # ---- the lowering rule ---------------------------------------------------

  def _record(self, params, avals_in):
    import jax  # pylint: disable=g-import-not-at-top
    from jax._src.pallas import pallas_call as pc  # pylint: disable=g-import-not-at-top
    structs = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals_in)
    jaxpr = params['jaxpr']
    # jax 0.11 names the kernel `name`; 0.10 `name_and_src_info`.
    name = (params.get('name') or params.get('name_and_src_info')
            or getattr(getattr(jaxpr, 'debug_info', None), 'func_name',
                       'kernel'))
    name = getattr(name, 'name', name)
    key = (str(name), structs, hashlib.sha1(
        f'{jaxpr}|{params["grid_mapping"]}|{params.get("compiler_params")}'
        .encode()).hexdigest())
    self.per_test[self.current] = self.per_test.get(self.current, 0) + 1
    entry = self.kernels.get(key)
    if entry is None:
      shapes = ', '.join(
          f'{s.dtype.name}[{",".join(map(str, s.shape))}]' for s in structs)
      entry = self.kernels[key] = {
          'label': f'{name}({shapes}) #{key[2][:6]}',
          'fn': lambda *xs, p=dict(params): pc.pallas_call_p.bind(
              *xs, interpret=False, **p),
          'args': structs, 'tests': []}
    if self.current not in entry['tests']:
      entry['tests'].append(self.current)

  def install(self):
    import jax  # pylint: disable=g-import-not-at-top
    from jax._src import config as jax_config  # pylint: disable=g-import-not-at-top
    from jax._src.interpreters import mlir  # pylint: disable=g-import-not-at-top
    from jax._src.pallas import pallas_call as pc  # pylint: disable=g-import-not-at-top
    original = pc._pallas_call_lowering  # pylint: disable=protected-access

    def cpu_rule(ctx, *in_nodes, interpret, **params):
      if not interpret:
        self._record(params, ctx.avals_in)
        interpret = True
        params['jaxpr'] = _cpu_precisions(params['jaxpr'])
        # Inside a shard_map that checks varying axes, jax's interpreter
        # refuses to index a ref that varies with a value that does not
        # (a grid index): a check of types only, which a GPU's lowering
        # does not make. The interpreter traces unchecked, on avals
        # cleared of their varying axes (the HLO is the same).
        ctx = ctx.replace(avals_in=[_invariant(a) for a in ctx.avals_in],
                          avals_out=[_invariant(a) for a in ctx.avals_out])
        with jax_config._check_vma(False):  # pylint: disable=protected-access
          return original(ctx, *in_nodes, interpret=interpret, **params)
      return original(ctx, *in_nodes, interpret=interpret, **params)

    # Registered for the CPU only: the CUDA lowering (step 3) keeps jax's.
    mlir.register_lowering(pc.pallas_call_p, cpu_rule, platform='cpu')
    self._undo.append(lambda: mlir.register_lowering(
        pc.pallas_call_p, original, platform='cpu'))

    # Mosaic GPU kernels (plgpu.kernel: index_mosaic.py, kv_outer_mosaic.py)
    # do not lower through pallas_call's rule above, and interpreting is
    # chosen when they are traced: they are traced for jax's GPU
    # interpreter (shared memory, barriers and TMA simulated), as this
    # jax's interpreter takes them. They are not recorded, as step 3
    # compiles with Triton; their CUDA lowering is tested in tests/msa
    # (test_msa_index_mosaic.py, test_msa_kv_outer_mosaic.py).
    from pallas_kernels.msa import mosaic_common  # pylint: disable=g-import-not-at-top
    params = mosaic_common.interpret_params
    mosaic_common.interpret_params = lambda interpret: params(True)
    self._undo.append(functools.partial(setattr, mosaic_common,
                                        'interpret_params', params))

    # The branch a GPU compile takes.
    platform_dependent = jax.lax.platform_dependent

    def as_on_a_gpu(*args, default=None, **per_platform):
      per_platform['cpu'] = per_platform.get('cuda', default)
      if per_platform['cpu'] is None:  # No branch for a GPU: jax's error.
        del per_platform['cpu']
      return platform_dependent(*args, default=default, **per_platform)

    jax.lax.platform_dependent = as_on_a_gpu
    self._undo.append(
        lambda: setattr(jax.lax, 'platform_dependent', platform_dependent))

    # What a GPU backend picks when nothing is named (the defaults read
    # jax.default_backend()), but the exchange: XLA:CPU has no ragged
    # all-to-all.
    # pylint: disable=g-import-not-at-top
    from foremoe_jax.model import grouped_swiglu
    from pallas_kernels.msa import api as msa_api
    default_kind, resolve_impl = (grouped_swiglu.default_kind,
                                  msa_api.resolve_impl)
    grouped_swiglu.default_kind = lambda backend=None: 'pallas'

    def gpu_impl(impl, pallas_backend=None):
      # 'auto' is the Pallas path on a GPU; a named impl stays as named.
      impl, backend, _ = resolve_impl('pallas' if impl == 'auto' else impl,
                                      pallas_backend or 'gpu')
      return impl, backend, False

    msa_api.resolve_impl = gpu_impl
    self._undo.append(lambda: setattr(grouped_swiglu, 'default_kind',
                                      default_kind))
    self._undo.append(lambda: setattr(msa_api, 'resolve_impl', resolve_impl))

  def uninstall(self):
    while self._undo:
      self._undo.pop()()

  # ---- pytest hooks --------------------------------------------------------

  @pytest.hookimpl(tryfirst=True)
  def pytest_runtest_setup(self, item):
    self.current = item.nodeid

  def pytest_runtest_logreport(self, report):
    if report.when == 'call' or (report.when == 'setup' and
                                 report.outcome != 'passed'):
      self.outcomes[report.nodeid] = report.outcome

  def pytest_sessionfinish(self, session):
    self.uninstall()
    rows, summary = self.compile_all()
    self.summary = summary
    tests = {nodeid: {'outcome': outcome,
                      'kernel_launches': self.per_test.get(nodeid, 0)}
             for nodeid, outcome in sorted(self.outcomes.items())}
    # pylint: disable=g-import-not-at-top
    from foremoe_jax.utils import results
    from foremoe_jax.utils.run_info import run_info
    from pallas_kernels.msa import gpu_static
    run = run_info({'bench': 'gpu_rehearsal', 'target': 'sm_90a (H100)',
                    'triton': gpu_static.triton_version(),
                    'pytest_args': list(session.config.invocation_params.args)})
    results.save('gpu_rehearsal', run,
                 {'tests': tests, 'summary': summary, 'rows': rows},
                 results_dir=os.environ.get(DIR_ENV, results.DEFAULT_DIR),
                 command='make gpu-rehearsal')
    if (summary['errors'] or summary['over_shared_memory']) and \
        session.exitstatus == 0:
      session.exitstatus = 1

  def compile_all(self):
    """Every recorded kernel, lowered for CUDA and compiled for sm_90a."""
    from pallas_kernels.msa import gpu_static  # pylint: disable=g-import-not-at-top
    start = time.time()
    entries = {e['label']: e for e in self.kernels.values()}
    # The jaxprs recorded inside a shard_map carry its mesh: the H100 is
    # named through jax's GPU table, not an abstract mesh.
    rows = gpu_static.report(
        {label: (e['fn'], e['args']) for label, e in entries.items()},
        target=gpu_static.h100_gpu_table)
    for r in rows:
      r['tests'] = entries[r['site']]['tests']
    summary = gpu_static.summary(rows)
    summary['recorded'] = len(self.kernels)
    summary['compile_seconds'] = round(time.time() - start, 1)
    return rows, summary

  def pytest_terminal_summary(self, terminalreporter):
    tr = terminalreporter
    tr.section('gpu rehearsal')
    for nodeid, outcome in sorted(self.outcomes.items()):
      tr.write_line(f'{outcome:8s} {self.per_test.get(nodeid, 0):4d} kernel '
                    f'launches lowered  {nodeid}')
    s = self.summary
    if s is not None:
      tr.write_line(
          f'{len(self.kernels)} distinct kernels compiled for sm_90a in '
          f'{s["compile_seconds"]} s: {s["kernels"]} compiled, errors '
          f'{s["errors"]}, over shared memory {s["over_shared_memory"]}, '
          f'spilling {s["spilling"]}, max shared '
          f'{s["max_shared_bytes"] / 1024:.1f} KiB')
