"""What an H100 launches for each MSA call, compiled by XLA on this host.

  make gpu-launches          # a separate venv with the CUDA PJRT plugin,
                             # then this; writes results/gpu_launches.json
  python -m experiments.gpu_launches --json     # in that venv
  python -m experiments.gpu_launches --calls=decode --launches

Each call a user makes at the GPU bench's shapes (decode at a 128k cache,
batch 8; prefill and its training backward at 32k, per GPU kernel set;
and the cuDNN dense attention the bench compares with) is compiled whole
by XLA's own GPU compiler for a compile-only H100: the Pallas kernels, the
XLA glue around them, and the loops. So is one expert-parallel MoE layer,
forward and backward, on 8 compile-only H100s (a Qwen3-30B-A3B layer:
128 experts, top-8, model dim 2048, expert dim 768; 4,096 tokens a
device), per grouped-GEMM kind (`--moe_gemms`). One row per call: launches by kind,
the glue's launches and bytes, loops and the host syncs of loops whose
trip count XLA cannot prove, and the glue launches that move most. The
logic lives in pallas_kernels/msa/launches.py.

The plugin goes in its own venv (`make gpu-launches` builds .venv-launches):
installed beside jax in the project's venv, every CPU run without
JAX_PLATFORMS would try and fail to start CUDA first.
"""
import dataclasses
import os

from absl import app, flags

from experiments import common
from foremoe_jax.utils.run_info import print_run_info
from pallas_kernels.msa import benchmark_gpu
from pallas_kernels.msa import launches

_JSON = flags.DEFINE_bool('json', False, 'Print only setup + one JSON line '
                          '(progress on stderr).')
_CALLS = flags.DEFINE_list('calls', None, 'Only the calls whose name holds '
                           'one of these (default: all).')
_LAUNCHES = flags.DEFINE_bool('launches', False, 'Also print every launch '
                              'of each call.')
_MOE_GEMMS = flags.DEFINE_list('moe_gemms',
                               ['pallas', 'ragged_dot', 'tiles_static'],
                               'Grouped-GEMM kinds of the MoE layer calls '
                               '(grouped_swiglu.KINDS; pallas is the GPU '
                               'default); empty: none.')


def moe_calls(gemms, ep: int = 8, tokens: int = 4096, experts: int = 128,
              top_k: int = 8, d_model: int = 2048, d_ff: int = 768,
              replicas: int = 2) -> dict:
  """{name: (fn, args)}: the expert-parallel layer's forward and backward
  (routed_experts: weight transfer, exact-count dispatch by the GPU's
  ragged all-to-all, grouped SwiGLU) on `ep` compile-only H100s, per
  grouped-GEMM kind. Each device holds
  experts / ep experts plus `replicas` replica slots; a device's buffer
  holds twice its mean rows."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from foremoe_jax.model import dispatch_exact  # pylint: disable=g-import-not-at-top
  from foremoe_jax.model import expert_parallel as ep_lib  # pylint: disable=g-import-not-at-top
  # A GPU's exchange (this process's default backend is the CPU's).
  exchange = dispatch_exact.default_exchange('gpu')
  mesh = ep_lib.make_mesh(1, ep, devices=launches.compile_only_h100s(ep))
  n, spd = tokens * ep, experts // ep + replicas
  sds = jax.ShapeDtypeStruct
  bf = jnp.bfloat16
  args = (sds((n, d_model), bf), sds((n, top_k), jnp.int32),
          sds((n, top_k), jnp.float32), sds((n,), bool),
          sds((experts, d_model, d_ff), bf), sds((experts, d_model, d_ff), bf),
          sds((experts, d_ff, d_model), bf), sds((ep * spd,), jnp.int32),
          sds((ep, ep * spd), jnp.float32))

  def layer(gemm):
    def loss(x, ids, gates, valid, wg, wu, wd, slot_expert, share):
      y, _ = ep_lib.routed_experts(x, ids, gates, valid, wg, wu, wd,
                                   slot_expert, share, mesh=mesh,
                                   capacity=2 * tokens * top_k, gemm=gemm,
                                   exchange=exchange)
      return jnp.sum(y.astype(jnp.float32))
    return jax.value_and_grad(loss, argnums=(0, 2, 4, 5, 6))

  return {f'moe layer x{ep}, {gemm}': (layer(gemm), args) for gemm in gemms}


def _line(name: str, out: dict) -> str:
  if 'error' in out:
    return f'{name:<26} ERROR {out["error"][:200]}'
  s = out['summary']
  kinds = ' '.join(f'{k} {n}' for k, n in s['by_kind'].items())
  return (f"{name:<26} {s['launches']:4d} launches ({kinds}); glue "
          f"{s['glue_launches']} launches, {s['glue_bytes'] / 1e9:.3f} GB; "
          f"loops {len(s['loops'])}, host syncs {s['host_syncs']}")


def main(argv):
  del argv
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  if not launches.plugin_available():
    raise app.UsageError(launches.PLUGIN_HINT + '; or run `make '
                         'gpu-launches`.')
  cfg = benchmark_gpu.GPUBench()
  run = print_run_info({'bench': 'gpu_launches', 'target': 'NVIDIA H100 '
                        '(compile-only)', 'calls': _CALLS.value,
                        **dataclasses.asdict(cfg)})
  calls = launches.msa_calls(cfg)
  calls.update(moe_calls(_MOE_GEMMS.value))
  if _CALLS.value:
    calls = {n: c for n, c in calls.items()
             if any(s in n for s in _CALLS.value)}
  log = common.progress(_JSON.value)

  def show(name, out):
    log(_line(name, out))
    if _LAUNCHES.value and 'launches' in out:
      for r in out['launches']:
        log(f"    {r['kind']:<8} x{r['times']:<3} {r['name'][:34]:<34} "
            f"{str(r.get('shape', ''))[:44]:<44} "
            f"w {r.get('write_bytes', 0) / 1e6:9.2f} MB "
            f"r {r.get('read_bytes', 0) / 1e6:9.2f} MB {r.get('grid', '')}")

  result = launches.audit(calls, log=show,
                          unplaced=[n for n in calls if n.startswith('moe')])
  common.finish('gpu_launches', run, {'calls': result},
                subset=bool(_CALLS.value))


if __name__ == '__main__':
  app.run(main)
