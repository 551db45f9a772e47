"""What an H100 would make of the MSA Triton kernels, found without one.

A GPU is lent rarely and briefly, and a kernel that asks for more shared
memory than the card has, spills its registers, or misses the tensor
cores costs that time. All three are decided at compile time, so they can
be read on a CPU host:

1. **Capture** (`triton_kernels`): jax lowers a function for CUDA (an
   abstract H100 stands in for the device) and every `pallas_call` on the
   way hands its Triton module, launch grid, warps and pipeline stages to
   us; launches of the same module (the query chunks of one call) are
   counted, not repeated.
2. **Compile** (`compile_sm90`): the `triton` package (the `gpu-static`
   extra; CPU wheels carry ptxas and nvdisasm) takes each module through
   its passes to sm_90a machine code, as the device does. We read shared
   memory from Triton's metadata, registers and spills from `ptxas -v`, and
   the instruction mix from the disassembly: HGMMA and QGMMA (wgmma,
   Hopper's warpgroup tensor-core MMA, on 16- and 8-bit floats), HMMA
   (mma.sync, the older and slower path),
   local-memory loads/stores (spills), global reductions (atomics).
3. **Occupancy** (`occupancy`): thread blocks per SM from registers, shared
   memory and warps, by the CUDA occupancy rules for compute capability 9.0.

The module comes from this host's jax and is compiled by the package's
Triton, not the GPU image's jax and the Triton built into its XLA, so a
number here is a close estimate, not the device's own.

Letter key: as in kv_outer.py.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import hashlib
import io
import os
import re
import subprocess
import sys
import tempfile

import jax

from pallas_kernels.msa import benchmark

# Compute capability 9.0 (H100, H200): per-SM limits of the CUDA occupancy
# calculator, and the most shared memory one thread block may ask for.
SM90 = dict(regs_per_sm=65536, reg_alloc_unit=256,
            smem_per_sm=233472, smem_per_block=232448,
            smem_reserved_per_block=1024, max_warps_per_sm=64,
            max_blocks_per_sm=32)

# SASS opcodes worth counting, by what they say about a kernel.
OPCODES = {
    'HGMMA': 'wgmma: warpgroup tensor-core MMA (Hopper), 16-bit floats',
    'QGMMA': 'wgmma on 8-bit floats (e4m3, e5m2)',
    'HMMA': 'mma.sync: warp-level tensor-core MMA',
    'LDL': 'local-memory load (register spill)',
    'STL': 'local-memory store (register spill)',
    'RED': 'global reduction (atomic without return)',
    'ATOM': 'global atomic',
    'LDGSTS': 'asynchronous global-to-shared copy (cp.async)',
    'UTMALDG': 'TMA load',
}


@dataclasses.dataclass(frozen=True)
class TritonKernel:
  """One Triton module as jax would hand it to the GPU compiler."""
  name: str
  ttir: str
  num_warps: int
  num_stages: int
  grid: tuple[int, ...]
  launches: int = 1

  @property
  def digest(self) -> str:
    return hashlib.sha1(
        f'{self.ttir}|{self.num_warps}|{self.num_stages}'.encode()
    ).hexdigest()[:12]


def cuda_lowering():
  """A context in which Triton kernels lower for CUDA on a host with no GPU.

  From jax 0.11 the Triton lowering asks the device for its compute
  capability, and with no GPU it must be told the target: an abstract H100
  (the GPU the kernels are sized for). A no-op where a GPU is present.
  """
  if jax.default_backend() == 'gpu':
    return contextlib.nullcontext()
  device = jax.sharding.AbstractDevice(device_kind='NVIDIA H100',
                                       num_cores=None, platform='gpu')
  mesh = jax.sharding.AbstractMesh((1,), ('lowering',),
                                   (jax.sharding.AxisType.Auto,),
                                   abstract_device=device)
  return jax.sharding.use_abstract_mesh(mesh)


@contextlib.contextmanager
def h100_gpu_table():
  """cuda_lowering for kernels whose jaxprs were traced inside a shard_map:
  their values carry that shard_map's mesh, which the abstract mesh of
  cuda_lowering clashes with. The H100 is named through jax's GPU table
  instead (absent before jax 0.11, which needs no target)."""
  try:
    from jax._src.pallas.triton import gpu_info  # pylint: disable=g-import-not-at-top
  except ImportError:
    yield
    return
  if jax.default_backend() == 'gpu':
    yield
    return
  original = gpu_info.get_gpu_info
  h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
  gpu_info.get_gpu_info = lambda: h100
  try:
    yield
  finally:
    gpu_info.get_gpu_info = original


@contextlib.contextmanager
def _captured_modules():
  """Yields a list that fills with a TritonKernel per pallas_call lowered
  for CUDA inside the context.

  jax's Triton lowering takes the warps and stages in its caller's frame
  (`pallas_call_lowering`) and passes only the kernel's jaxpr down: we
  wrap the one function it calls and read them there. The grid is the
  (x, y, z) launch grid, as jax normalises it.
  """
  from jax._src.pallas.triton import lowering  # pylint: disable=g-import-not-at-top
  from jax._src.pallas.triton import pallas_call_registration as registration  # pylint: disable=g-import-not-at-top
  found = []
  original = lowering.lower_jaxpr_to_triton_module

  def capture(*args, **kwargs):
    result = original(*args, **kwargs)
    caller = sys._getframe(1).f_locals  # pylint: disable=protected-access
    if 'num_warps' not in caller or 'num_stages' not in caller:
      raise RuntimeError('gpu_static: this jax names the Triton launch '
                         'parameters differently; update _captured_modules.')
    op = result.module.operation
    name = op.attributes['sym_name'].value if 'sym_name' in op.attributes \
        else 'kernel'
    found.append(TritonKernel(
        name=name, ttir=op.get_asm(), num_warps=int(caller['num_warps']),
        num_stages=int(caller['num_stages']),
        grid=tuple(int(x) for x in registration.normalize_grid(
            result.grid))))
    return result

  lowering.lower_jaxpr_to_triton_module = capture
  try:
    yield found
  finally:
    lowering.lower_jaxpr_to_triton_module = original


def triton_kernels(fn, *args, target=cuda_lowering) -> list[TritonKernel]:
  """The Triton kernels `fn(*args)` launches on a GPU, in lowering order.

  args may be jax.ShapeDtypeStructs: nothing runs, only lowers. The same
  module launched again (the query chunks of one call) is one entry whose
  `launches` counts them. target: the context naming the GPU
  (cuda_lowering, or h100_gpu_table).
  """
  with target(), _captured_modules() as found:
    # A fresh function each call: jax caches lowerings by function, and a
    # cached one would lower (and hand over) nothing.
    jax.jit(lambda *a: fn(*a)).trace(*args).lower(
        lowering_platforms=('cuda',))
  unique: dict[str, TritonKernel] = {}
  for k in found:
    seen = unique.get(k.digest)
    unique[k.digest] = (k if seen is None else
                        dataclasses.replace(seen, launches=seen.launches + 1))
  return list(unique.values())


def triton_version() -> str | None:
  """The installed `triton` package's version (None: not installed)."""
  try:
    import triton  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return triton.__version__


def _tool(name: str) -> str:
  import triton  # pylint: disable=g-import-not-at-top
  path = os.path.join(os.path.dirname(triton.__file__), 'backends', 'nvidia',
                      'bin', name)
  if not os.path.exists(path):
    raise FileNotFoundError(f'gpu_static: {path} is missing; the triton '
                            f'wheel for Linux x86_64 ships it.')
  return path


_PTXAS_LINE = re.compile(
    r'(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill '
    r'loads.*?Used (\d+) registers', re.S)
_SASS_OP = re.compile(r'^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?'
                      r'([A-Z][A-Z0-9_]*)', re.M)


def ptxas_usage(ptxas_output: str) -> dict:
  """{'registers', 'spill_store_bytes', 'spill_load_bytes', 'stack_bytes'}
  of the one entry function in `ptxas -v` output."""
  m = _PTXAS_LINE.search(ptxas_output)
  if m is None:
    raise ValueError(f'gpu_static: no usage line in ptxas output:\n'
                     f'{ptxas_output[-2000:]}')
  stack, st, ld, regs = (int(x) for x in m.groups())
  return {'registers': regs, 'spill_store_bytes': st, 'spill_load_bytes': ld,
          'stack_bytes': stack}


def sass_opcodes(sass: str) -> collections.Counter:
  """Opcode counts of a disassembly (`nvdisasm -c`), modifiers dropped:
  'HGMMA.64x128x16.F32.BF16' counts as HGMMA."""
  return collections.Counter(_SASS_OP.findall(sass))


def occupancy(registers: int, shared_bytes: int, num_warps: int,
              limits: dict = SM90) -> dict:
  """Thread blocks an SM holds at once, and which resource bounds it.

  Registers are given out per warp in units of reg_alloc_unit; every
  block also costs smem_reserved_per_block of shared memory. 0 blocks:
  the kernel cannot launch (too much shared memory for one block).
  limited_by: every resource that allows no more blocks than that.
  """
  per_warp = -(-registers * 32 // limits['reg_alloc_unit']) * \
      limits['reg_alloc_unit']
  by = {
      'registers': limits['regs_per_sm'] // max(per_warp * num_warps, 1),
      'shared_memory': (
          0 if shared_bytes > limits['smem_per_block'] else
          limits['smem_per_sm'] // (shared_bytes +
                                    limits['smem_reserved_per_block'])),
      'warps': limits['max_warps_per_sm'] // num_warps,
      'blocks': limits['max_blocks_per_sm'],
  }
  blocks = min(by.values())
  return {'blocks_per_sm': blocks,
          'limited_by': sorted(k for k, v in by.items() if v == blocks),
          'warps_per_sm': blocks * num_warps,
          'by': by}


# compile_sm90's reports by kernel digest, for this process: sites share
# kernels (the dK/dV per-block sums, the selector's top-k), and each
# compile takes seconds of Triton, ptxas and nvdisasm.
_REPORTS: dict[str, dict] = {}


def compile_sm90(kernel: TritonKernel) -> dict:
  """Compiles one captured module for sm_90a with the `triton` package and
  reports what the machine code asks of an H100.

  Returns {shared_bytes, fits_shared (<= 227 KiB), registers,
  spill_store_bytes, spill_load_bytes, stack_bytes, opcodes (the OPCODES
  counted), occupancy}; raises what Triton or ptxas raised. A module
  compiled before in this process (the same digest) is not compiled again.
  """
  if kernel.digest not in _REPORTS:
    _REPORTS[kernel.digest] = _compile_sm90(kernel)
  return copy.deepcopy(_REPORTS[kernel.digest])


def _compile_sm90(kernel: TritonKernel) -> dict:
  import triton  # pylint: disable=g-import-not-at-top
  from triton.backends.compiler import GPUTarget  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as work:
    src = os.path.join(work, f'{kernel.name}_{kernel.digest}.ttir')
    with open(src, 'w') as f:
      f.write(kernel.ttir)
    # Triton runs `ptxas -v` for the cubin and, asked to, prints its log:
    # the usage report, of the very cubin disassembled below.
    log = io.StringIO()
    with triton.knobs.nvidia.scope(), contextlib.redirect_stdout(log):
      triton.knobs.nvidia.dump_ptxas_log = True
      compiled = triton.compile(
          src, target=GPUTarget('cuda', 90, 32),
          options={'num_warps': kernel.num_warps,
                   'num_stages': kernel.num_stages})
    usage = log.getvalue()
    cubin = os.path.join(work, f'{kernel.name}_{kernel.digest}.cubin')
    with open(cubin, 'wb') as f:
      f.write(compiled.asm['cubin'])
    if not _PTXAS_LINE.search(usage):
      # From Triton's cache (nothing compiled, no log): the same PTX
      # through ptxas once more, verbose.
      ptx = os.path.join(work, f'{kernel.name}_{kernel.digest}.ptx')
      with open(ptx, 'w') as f:
        f.write(compiled.asm['ptx'])
      run = subprocess.run(
          [_tool('ptxas'), '-v', '-arch=sm_90a', ptx, '-o',
           os.path.join(work, 'usage.cubin')],
          capture_output=True, text=True, check=True)
      usage = run.stdout + run.stderr
    # No dataflow analysis (-ndf): it only labels branch targets, and
    # costs a quarter of the disassembler's time.
    sass = subprocess.run([_tool('nvdisasm'), '-c', '-ndf', cubin],
                          capture_output=True, text=True, check=True).stdout
  report = ptxas_usage(usage)
  shared = int(compiled.metadata.shared)
  ops = sass_opcodes(sass)
  report.update({
      'shared_bytes': shared,
      'fits_shared': shared <= SM90['smem_per_block'],
      'opcodes': {op: ops.get(op, 0) for op in OPCODES},
      'occupancy': occupancy(report['registers'], shared, kernel.num_warps),
  })
  return report


def row(kernel: TritonKernel, label: str, report: dict | None = None,
        error: str | None = None) -> dict:
  """One kernel's line of the static report."""
  out = {'site': label, 'kernel': kernel.name, 'num_warps': kernel.num_warps,
         'num_stages': kernel.num_stages, 'grid': list(kernel.grid),
         'launches': kernel.launches}
  if report is not None:
    out.update(report)
  if error is not None:
    out['error'] = error
  return out


# ----------------------------------------------------------------------------
# The MSA kernels, at the shapes the GPU bench times them


def msa_sites(cfg=None, *, f32_len: int = 2048) -> dict:
  """{site: (fn, args)} for every Triton kernel `make gpu-check` compiles.

  In the bench's dtype (bf16) at its shapes: prefill at tune_len (the
  two-launch selector, with fp8 scores too, and its score launch's
  INDEX_VARIANTS; the KV-outer forward, its
  default and every TUNE variant; the per-token and union-tile forwards;
  the backward's
  dQ and dK/dV kernels, dK/dV with its prefetch and in two key parts),
  and decode at the
  longest decode_len and decode_batch. In f32 at f32_len and the GPU
  tests' real head shapes: the selector, forward, backward and decode that
  tests/msa/test_msa_gpu.py compiles (shared memory depends on the tiles,
  not on the length).
  """
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from pallas_kernels.msa import benchmark_gpu  # pylint: disable=g-import-not-at-top
  from pallas_kernels.msa import index_kernel  # pylint: disable=g-import-not-at-top
  from pallas_kernels.msa import pallas_path  # pylint: disable=g-import-not-at-top
  from pallas_kernels.msa import select_kernel  # pylint: disable=g-import-not-at-top
  cfg = cfg or benchmark_gpu.GPUBench()
  g, r, d, di = cfg.groups, cfg.heads_per_group, cfg.head_dim, cfg.index_dim
  c, k = cfg.block_size, cfg.top_k
  shape = jax.ShapeDtypeStruct
  i32 = jnp.int32

  def prefill(dtype, t, label=''):
    q = shape((1, t, g * r, d), dtype)
    kv = shape((1, t, g, d), dtype)
    qi, ki = shape((1, t, g, di), dtype), shape((1, t, di), dtype)
    sel, off = shape((1, g, t, k), i32), shape((1,), i32)
    lse = shape((1, t, g * r), jnp.float32)
    select = functools.partial(select_kernel.select_blocks_BGTK, block_size=c,
                               top_k=k, backend='gpu', interpret=False)
    fwd = functools.partial(pallas_path.sparse_forward, block_size=c,
                            backend='gpu', interpret=False)

    def bwd(**kw):
      return lambda q, kv_, v, sel, off, lse: pallas_path.sparse_backward(
          q, kv_, v, sel, off, None, q, lse, q, None, block_size=c,
          backend='gpu', interpret=False, **kw)

    out = {f'{label}index': (select, (qi, ki, off)),
           f'{label}main': (fwd, (q, kv, kv, sel, off)),
           f'{label}bwd_dq': (bwd(parts='dq'), (q, kv, kv, sel, off, lse)),
           f'{label}bwd_dkv': (bwd(parts='dkv'), (q, kv, kv, sel, off, lse))}
    if not label:
      out['index_fp8'] = (functools.partial(select, fp8_scores=True),
                          (qi, ki, off))
      for kw in benchmark_gpu.INDEX_VARIANTS:
        out[f'index[{benchmark_gpu.index_variant_label(kw)}]'] = (
            functools.partial(index_kernel.index_scores, block_size=c,
                              interpret=False, **kw), (qi, ki, off))
      out.update({f'main[{cfg_.label()}]': (
          functools.partial(fwd, kv_config=cfg_), (q, kv, kv, sel, off))
                  for cfg_ in benchmark_gpu.TUNE})
      out['main_token'] = (functools.partial(fwd, gpu_kernels='token'),
                           (q, kv, kv, sel, off))
      out['main_tiles'] = (functools.partial(fwd, gpu_kernels='tiles'),
                           (q, kv, kv, sel, off))
      out['bwd_dq_tiles'] = (bwd(parts='dq', gpu_kernels='tiles'),
                             (q, kv, kv, sel, off, lse))
      out['bwd_dkv_prefetch'] = (bwd(parts='dkv', dkv_prefetch=True),
                                 (q, kv, kv, sel, off, lse))
      out['bwd_dkv_parts2'] = (bwd(parts='dkv', dkv_parts=2),
                               (q, kv, kv, sel, off, lse))
    return out

  def decode(dtype, b, s, label=''):
    dec = functools.partial(pallas_path.msa_decode, block_size=c, top_k=k,
                            backend='gpu', interpret=False)
    return {f'{label}decode': (dec, (
        shape((b, g * r, d), dtype), shape((b, s, g, d), dtype),
        shape((b, s, g, d), dtype), shape((b, g, di), dtype),
        shape((b, s, di), dtype), shape((b,), i32)))}

  dtype = jnp.dtype(cfg.dtype)
  sites = prefill(dtype, cfg.tune_len)
  sites.update(decode(dtype, cfg.decode_batch, max(cfg.decode_lens)))
  sites.update(prefill(jnp.float32, f32_len, 'f32 '))
  sites.update(decode(jnp.float32, 1, f32_len, 'f32 '))
  return sites


def grouped_matmul_sites() -> dict:
  """{site: (fn, args)}: the MoE layer's GPU grouped SwiGLU (forward and
  its VJP: pallas_kernels/grouped_matmul.swiglu, rows in and out) in bf16
  at a Qwen3-30B-A3B layer on 8 devices (65,536 rows in 530 tiles of 128,
  18 slots, model dim 2048, expert dim 768; f32 master weights) and in f32
  at the GPU tests' shapes (tests/model/test_expert_parallel_gpu.py,
  tests/grouped_matmul/test_grouped_matmul_gpu.py)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from pallas_kernels.grouped_matmul import kernel as gm  # pylint: disable=g-import-not-at-top
  shape = jax.ShapeDtypeStruct

  def fwd_bwd(x, wg, wu, wd, src, slot, used, dy):
    y, vjp = jax.vjp(lambda *w: gm.swiglu(*w, src, slot, used, False),
                     x, wg, wu, wd)
    return y, vjp(dy)

  def site(rows, n, t, m, f, s, dtype, w_dtype):
    return (fwd_bwd, (shape((rows, m), dtype), shape((s, m, f), w_dtype),
                      shape((s, m, f), w_dtype), shape((s, f, m), w_dtype),
                      shape((n, t), jnp.int32), shape((n,), jnp.int32),
                      shape((1,), jnp.int32), shape((rows, m), dtype)))
  def tiles_site(n, t, k, big_n, s, dtype, w_dtype):
    def tiles_fwd_bwd(x, w, slot, used, dy):
      y, vjp = jax.vjp(lambda a, b: gm.tile_matmul(a, b, slot, used, False),
                       x, w)
      return y, vjp(dy)
    return (tiles_fwd_bwd, (shape((n, t, k), dtype),
                            shape((s, k, big_n), w_dtype),
                            shape((n,), jnp.int32), shape((1,), jnp.int32),
                            shape((n, t, big_n), dtype)))
  return {'moe swiglu 2048x768': site(65536, 530, 128, 2048, 768, 18,
                                      jnp.bfloat16, jnp.float32),
          'f32 moe swiglu': site(256, 8, 128, 32, 48, 24, jnp.float32,
                                 jnp.float32),
          # tests/grouped_matmul/test_grouped_matmul_gpu.py's shapes.
          'f32 gmm test swiglu': site(700, 9, 128, 256, 384, 5, jnp.float32,
                                      jnp.float32),
          'f32 gmm test tiles': tiles_site(9, 128, 256, 384, 5, jnp.float32,
                                           jnp.float32)}


def report(sites: dict, log=None, target=cuda_lowering) -> list[dict]:
  """A row per (site, distinct kernel): captured, compiled, or the error
  that stopped either (the other sites still go on). target: as in
  triton_kernels."""
  rows = []
  for label, (fn, args) in sites.items():
    try:
      kernels = triton_kernels(fn, *args, target=target)
    except Exception as e:  # pylint: disable=broad-except
      rows.append({'site': label,
                   'error': f'lowering: {benchmark.error_text(e)}'})
      continue
    for kernel in kernels:
      try:
        rows.append(row(kernel, label, compile_sm90(kernel)))
      except Exception as e:  # pylint: disable=broad-except
        rows.append(row(kernel, label, error=benchmark.error_text(e)))
      if log is not None:
        log(rows[-1])
  return rows


def summary(rows: list[dict]) -> dict:
  """What a GPU run would trip over: kernels that cannot launch (shared
  memory), kernels that spill, bf16/fp8 dots off the warpgroup MMA, and
  errors."""
  ok = [r for r in rows if 'error' not in r]
  return {
      'kernels': len(ok),
      'errors': [r['site'] for r in rows if 'error' in r],
      'over_shared_memory': sorted({f"{r['site']}: {r['kernel']}"
                                    for r in ok if not r['fits_shared']}),
      'spilling': sorted({f"{r['site']}: {r['kernel']}"
                          for r in ok if r['spill_store_bytes']}),
      'without_wgmma': sorted({f"{r['site']}: {r['kernel']}" for r in ok
                               if r['opcodes']['HMMA']
                               and not r['opcodes']['HGMMA']
                               and not r['opcodes']['QGMMA']}),
      'max_shared_bytes': max((r['shared_bytes'] for r in ok), default=0),
  }
