"""What an H100 will launch for an MSA call, found without one.

gpu_static.py compiles each Triton kernel alone. Around them sit the XLA
ops that plan, pad and merge (tile lists, masks, the log-sum-exp combine),
and on a GPU each is a kernel launch of its own: a few microseconds each,
and a decode step at 128k has about a hundred microseconds of memory
traffic in all. A loop whose trip count XLA cannot prove also copies its
predicate to the host every iteration, which stalls the stream.

Here the whole jitted call is compiled by XLA's own GPU compiler for a
compile-only H100 (jax's deviceless AOT path: a PJRT topology built from a
target description, `H100_TARGET`, no GPU or driver needed), and the
optimized module's entry computation is read launch by launch:

  kind      what it is
  triton      a Pallas kernel (XLA's Triton custom call), with its grid
  gemm        a matmul XLA emits itself (its Triton GEMM or a library call)
  library     another library call (cuDNN attention, cuBLAS)
  collective  a communication op (its start; the wait launches nothing)
  fusion      an XLA loop/input fusion: the glue
  copy        a copy or other unfused op that moves memory

A while loop's body and condition are launched once per iteration: counted
times the trip count when XLA knows it (`known_trip_count`), once and
flagged `host_sync` when it does not.

Bytes are the sizes of a launch's result (written) and operands (read; an
upper bound: a kernel may read part of an operand). A slice counts what it
keeps; a scatter or dynamic-update-slice (in place) its operands but the
largest, the buffer. They say where the glue moves memory, not how long it
takes.

Needs the CUDA PJRT plugin matching the installed jax (the `gpu-launches`
extra: jax-cuda13-plugin and jax-cuda13-pjrt, about 140 MB; no CUDA
libraries). cuDNN's dense attention compiles only where the cuDNN wheels
are installed too (jax[cuda13]); without them its row records the error.

Letter key: as in kv_outer.py.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import re

import jax
import jax.numpy as jnp

# The device XLA compiles for: an H100 SXM (80 GB HBM3), in XLA's
# GpuTargetConfig text format. Compile decisions read the compute
# capability, SM count, shared memory and register limits; the clock and
# bandwidth feed XLA's cost model.
H100_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84929347584
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 19 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""

PLUGIN_HINT = ("the CUDA PJRT plugin matching jax is missing: pip install "
               "-e '.[gpu-launches]' (jax-cuda13-plugin and jax-cuda13-pjrt "
               "of jax's version; no GPU or CUDA libraries needed)")

# Bytes per element of XLA's primitive types (the f8 family is one byte).
_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 's16': 2, 'u16': 2, 'f16': 2,
          'bf16': 2, 's32': 4, 'u32': 4, 'f32': 4, 's64': 8, 'u64': 8,
          'f64': 8, 'c64': 8, 'c128': 16, 's4': 1, 'u4': 1}
# Ops that launch nothing: views, constants, tuples, and the waits that
# end an asynchronous collective (its `-start` is the launch).
_FREE = {'parameter', 'constant', 'bitcast', 'get-tuple-element', 'tuple',
         'after-all', 'opt-barrier', 'add-dependency', 'partition-id',
         'replica-id', 'all-to-all-done', 'all-gather-done',
         'all-reduce-done', 'reduce-scatter-done', 'collective-permute-done',
         'ragged-all-to-all-done', 'copy-done', 'send-done', 'recv-done',
         'async-done'}
_COLLECTIVES = ('all-to-all', 'all-gather', 'all-reduce', 'reduce-scatter',
                'collective-permute', 'ragged-all-to-all', 'send', 'recv')
_CONTROL = {'while', 'conditional', 'call'}

_INSTR = re.compile(r'^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = (?P<shape>.+?) '
                    r'(?P<op>[a-z][\w\-]*)\((?P<rest>.*)$')
_COMP = re.compile(r'^(?P<entry>ENTRY )?%(?P<name>[\w.\-]+) \(.*\{\s*$')


@functools.lru_cache(maxsize=None)
def compile_only_h100s(n: int = 1) -> tuple:
  """n compile-only H100s on one host (jax.Devices, for a mesh);
  RuntimeError naming the install when the CUDA plugin is missing."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  try:
    topo = topologies.get_topology_desc('h100', 'cuda',
                                        target_config=H100_TARGET,
                                        topology=f'1x1x{n}')
  except Exception as e:  # pylint: disable=broad-except
    raise RuntimeError(f'{PLUGIN_HINT} ({type(e).__name__}: {e})') from e
  return tuple(topo.devices)


def compile_only_h100():
  """One compile-only H100 (see compile_only_h100s)."""
  return compile_only_h100s(1)[0]


def plugin_available() -> bool:
  try:
    compile_only_h100()
    return True
  except RuntimeError:
    return False


def optimized_hlo(fn, *args, place: bool = True) -> str:
  """The optimized HLO text of jit(fn) compiled for an H100, args being
  jax.ShapeDtypeStructs, placed on one compile-only device here, Pallas
  kernels lowered for an abstract H100 (place False: args as given, for a
  fn without Pallas kernels that runs a shard_map over a mesh of
  compile_only_h100s; the abstract device's mesh would clash with it)."""
  from pallas_kernels.msa import gpu_static  # pylint: disable=g-import-not-at-top
  context = contextlib.nullcontext()
  if place:
    sharding = jax.sharding.SingleDeviceSharding(compile_only_h100())
    args = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
        args)
    context = gpu_static.cuda_lowering()
  # Each call lowers a fresh wrapper: jax caches lowerings by function.
  with context:
    lowered = jax.jit(lambda *a: fn(*a)).lower(*args)
  return lowered.compile().as_text()


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string, tuples summed ('(f32[2,3]{1,0}, s32[])'
  is 28)."""
  total = 0
  for dtype, dims in re.findall(r'\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]',
                                shape):
    size = 1 if dtype.startswith('f8') else _BYTES.get(dtype)
    if size is None:
      continue
    n = 1
    for d in filter(None, dims.split(',')):
      n *= int(d)
    total += size * n
  return total


def _split_computations(hlo: str) -> tuple[dict, str]:
  """{computation name: its instruction lines}, and the entry's name."""
  comps, entry, current = {}, None, None
  for line in hlo.splitlines():
    m = _COMP.match(line)
    if m:
      current = m.group('name')
      comps[current] = []
      if m.group('entry'):
        entry = current
    elif current is not None:
      if line.strip() == '}':
        current = None
      else:
        comps[current].append(line)
  if entry is None:
    raise ValueError('no ENTRY computation in this HLO text')
  return comps, entry


def _operands(rest: str) -> list[str]:
  """The %names inside an instruction's operand parentheses."""
  depth, end = 1, len(rest)
  for i, ch in enumerate(rest):
    depth += {'(': 1, ')': -1}.get(ch, 0)
    if depth == 0:
      end = i
      break
  return re.findall(r'%([\w.\-]+)', rest[:end])


def _kind(op: str, line: str) -> str:
  if op.removesuffix('-start') in _COLLECTIVES:
    return 'collective'
  if op == 'custom-call':
    target = re.search(r'custom_call_target="([^"]+)"', line)
    target = target.group(1) if target else ''
    if 'triton' in target:
      return 'triton'
    return 'gemm' if ('gemm' in target or 'cublas' in target) else 'library'
  if op == 'fusion':
    # The fusion's own backend kind (an operand's name may say gemm too).
    kind = re.search(r'"fusion_backend_config":\{"kind":"([^"]+)"', line)
    kind = kind.group(1) if kind else ''
    if 'gemm' in kind or 'cublas' in kind:
      return 'gemm'
    if 'cudnn' in kind:
      return 'library'
    return 'fusion'
  return 'copy'


def _row(name: str, op: str, shape: str, line: str, sizes: dict,
         operands: list[str]) -> dict:
  kind = _kind(op, line)
  label = re.search(r'\bname = "([^"]+)"', line) if kind == 'triton' else None
  reads = [sizes.get(o, 0) for o in operands]
  row = {'name': label.group(1) if label else name, 'kind': kind, 'op': op,
         'shape': re.sub(r'\{[^}]*\}', '', shape),  # layouts dropped
         'write_bytes': shape_bytes(shape), 'read_bytes': sum(reads)}
  if re.search(r'scatter|dynamic.update.slice', f'{op} {name}') and reads:
    # In place: the buffer (the largest operand) is neither read nor
    # rewritten whole; the update is.
    row['read_bytes'] = row['write_bytes'] = sum(reads) - max(reads)
  elif re.search(r'slice', f'{op} {name}'):
    row['read_bytes'] = row['write_bytes']  # a slice reads what it keeps
  grid = re.search(r'grid_x = (\d+) : i32, grid_y = (\d+) : i32, '
                   r'grid_z = (\d+)', line)
  if grid:
    row['grid'] = [int(x) for x in grid.groups()]
  op_name = re.search(r'op_name="([^"]+)"', line)
  if op_name:
    row['source'] = op_name.group(1)[-160:]
  return row


def launches(hlo: str) -> list[dict]:
  """The launches of an optimized module's entry computation, in program
  order: {name, kind, op, shape, write_bytes, read_bytes, [grid], [source],
  times} with times the launches per call (a loop body's: its trip count).
  A while loop adds a row {kind: 'loop', trip_count (None: unknown),
  host_sync} before its body's rows."""
  comps, entry = _split_computations(hlo)
  out = []

  def walk(comp: str, times: int):
    sizes = {}
    for line in comps[comp]:
      m = _INSTR.match(line)
      if not m:
        continue
      name, shape, op = m.group('name'), m.group('shape'), m.group('op')
      sizes[name] = shape_bytes(shape)
      if op in _FREE:
        continue
      if op in _CONTROL:
        called = dict(re.findall(r'\b(condition|body|to_apply|'
                                 r'true_computation|false_computation)'
                                 r'=%([\w.\-]+)', line))
        branches = re.search(r'branch_computations=\{([^}]*)\}', line)
        if op == 'while':
          trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
          n = int(trip.group(1)) if trip else None
          out.append({'name': name, 'kind': 'loop', 'op': op,
                      'trip_count': n, 'host_sync': n is None,
                      'times': times})
          walk(called['condition'], times * (n + 1 if n else 1))
          walk(called['body'], times * (n or 1))
        else:
          targets = list(called.values())
          if branches:
            targets += re.findall(r'%([\w.\-]+)', branches.group(1))
          for c in targets:
            walk(c, times)
        continue
      row = _row(name, op, shape, line, sizes, _operands(m.group('rest')))
      row['times'] = times
      out.append(row)

  walk(entry, 1)
  return out


def summarize(rows: list[dict], top: int = 5) -> dict:
  """Launches per call by kind, the glue's bytes (fusions and copies: not
  a Pallas, GEMM or library kernel, nor a collective), loops, and the glue
  launches that move most."""
  count = collections.Counter()
  for r in rows:
    if r['kind'] != 'loop':
      count[r['kind']] += r['times']
  glue = [r for r in rows if r['kind'] in ('fusion', 'copy')]
  moved = lambda r: (r['read_bytes'] + r['write_bytes']) * r['times']
  return {
      'launches': sum(count.values()),
      'by_kind': dict(sorted(count.items())),
      'glue_launches': count['fusion'] + count['copy'],
      'glue_bytes': sum(moved(r) for r in glue),
      'kernel_bytes': sum(moved(r) for r in rows
                          if r['kind'] in ('triton', 'gemm', 'library')),
      'collective_bytes': sum(moved(r) for r in rows
                              if r['kind'] == 'collective'),
      'loops': [{'name': r['name'], 'trip_count': r['trip_count']}
                for r in rows if r['kind'] == 'loop'],
      'host_syncs': sum(r['times'] for r in rows
                        if r['kind'] == 'loop' and r['host_sync']),
      'largest_glue': [{'name': r['name'], 'shape': r['shape'],
                        'bytes': moved(r), 'source': r.get('source', '')}
                       for r in sorted(glue, key=moved, reverse=True)[:top]],
  }


# ----------------------------------------------------------------------------
# The calls a user makes, at the GPU bench's shapes


def msa_calls(cfg=None) -> dict:
  """{name: (fn, args)}: MSA decode (a new token per sequence against
  caches of the longest decode_len, decode_batch sequences), prefill at
  train_max_len and its training backward (the vjp for q, k, v, dO an
  input as in a real step), per GPU kernel set; and the dense cuDNN
  attention the bench compares them with."""
  from pallas_kernels.msa import benchmark  # pylint: disable=g-import-not-at-top
  from pallas_kernels.msa import benchmark_gpu  # pylint: disable=g-import-not-at-top
  from pallas_kernels.msa import pallas_path  # pylint: disable=g-import-not-at-top
  cfg = cfg or benchmark_gpu.GPUBench()
  g, r, d, di = cfg.groups, cfg.heads_per_group, cfg.head_dim, cfg.index_dim
  kw = dict(block_size=cfg.block_size, top_k=cfg.top_k, backend='gpu',
            interpret=False)
  dt = jnp.dtype(cfg.dtype)
  sds = jax.ShapeDtypeStruct
  b, s = cfg.decode_batch, max(cfg.decode_lens)
  t = cfg.train_max_len
  dec_args = (sds((b, g * r, d), dt), sds((b, s, g, d), dt),
              sds((b, s, g, d), dt), sds((b, g, di), dt), sds((b, s, di), dt),
              sds((b,), jnp.int32))
  pre_args = (sds((1, t, g * r, d), dt), sds((1, t, g, d), dt),
              sds((1, t, g, d), dt), sds((1, t, g, di), dt),
              sds((1, t, di), dt))

  def prefill(kernels):
    return lambda q, k, v, qi, ki: pallas_path.msa_attention(
        q, k, v, qi, ki, q_offset=0, gpu_kernels=kernels, **kw)[0]

  def train(kernels):
    def step(q, k, v, qi, ki, do):
      _, vjp = jax.vjp(lambda q_, k_, v_: prefill(kernels)(q_, k_, v_, qi, ki),
                       q, k, v)
      return vjp(do)
    return step

  dense_decode = functools.partial(benchmark.dense_decode,
                                   implementation=cfg.dense_impl)
  dense = functools.partial(benchmark_gpu.dense_prefill,
                            implementation=cfg.dense_impl)

  def dense_train(q, k, v, do):
    return jax.vjp(dense, q, k, v)[1](do)

  calls = {
      f'decode {s // 1024}k x{b}': (functools.partial(
          pallas_path.msa_decode, **kw), dec_args),
      f'decode {s // 1024}k x{b}, dense': (
          dense_decode, (dec_args[0], dec_args[1], dec_args[2], dec_args[5])),
  }
  for kernels in ('kv_outer', 'tiles'):
    calls[f'prefill {t // 1024}k, {kernels}'] = (prefill(kernels), pre_args)
  calls[f'prefill {t // 1024}k, dense'] = (dense, pre_args[:3])
  for kernels in ('kv_outer', 'tiles'):
    calls[f'train {t // 1024}k, {kernels}'] = (train(kernels),
                                                (*pre_args, pre_args[0]))
  calls[f'train {t // 1024}k, dense'] = (dense_train,
                                         (*pre_args[:3], pre_args[0]))
  return calls


def audit(calls: dict, log=None, unplaced=()) -> dict:
  """{name: {'summary', 'launches'} or {'error'}} for each call; the calls
  named in `unplaced` get their args as given (`optimized_hlo`'s place)."""
  from pallas_kernels.msa import benchmark  # pylint: disable=g-import-not-at-top
  out = {}
  for name, (fn, args) in calls.items():
    try:
      rows = launches(optimized_hlo(fn, *args, place=name not in unplaced))
      out[name] = {'summary': summarize(rows), 'launches': rows}
    except Exception as e:  # pylint: disable=broad-except
      out[name] = {'error': benchmark.error_text(e)}
    if log is not None:
      log(name, out[name])
  return out
