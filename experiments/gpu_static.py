"""The MSA Triton kernels compiled for an H100 on this host, no GPU needed.

  pip install -e '.[gpu-static]'          # the triton package (CPU wheel)
  python -m experiments.gpu_static --json
  python -m experiments.gpu_static --sites=main,bwd   # sites whose name
                                                      # holds one of these

Every kernel `make gpu-check` compiles, at the GPU bench's shapes (bf16
prefill at 32k with each forward variant, decode at a 128k cache and batch
8) and at the GPU tests' f32 shapes, and the MoE layer's grouped matmul, is lowered by jax for CUDA and taken
by Triton to sm_90a machine code. One row per (site, kernel): shared
memory (and whether it fits the 227 KiB a block may have), registers,
spills, blocks per SM and what bounds them, and the tensor-core
instructions (HGMMA, QGMMA: wgmma on 16- and 8-bit floats; HMMA:
mma.sync). The summary lists what a GPU
run would trip over. Written to results/gpu_static.json. The logic lives in
pallas_kernels/msa/gpu_static.py.
"""
import dataclasses

from absl import app, flags

from experiments import common
from foremoe_jax.utils.run_info import print_run_info
from pallas_kernels.msa import benchmark_gpu
from pallas_kernels.msa import gpu_static

_JSON = flags.DEFINE_bool('json', False, 'Print only setup + one JSON line '
                          '(progress on stderr).')
_SITES = flags.DEFINE_list('sites', None, 'Only the sites whose name holds '
                           'one of these (default: all).')


def _line(row: dict) -> str:
  if 'error' in row:
    return f"{row['site']:<48} ERROR {row['error'][:200]}"
  occ, ops = row['occupancy'], row['opcodes']
  return (f"{row['site']:<48} {row['kernel']:<22} w{row['num_warps']} "
          f"s{row['num_stages']} smem {row['shared_bytes'] / 1024:6.1f} KiB "
          f"regs {row['registers']:3d} spill {row['spill_store_bytes']:5d} B "
          f"{occ['blocks_per_sm']} blk/SM ({'+'.join(occ['limited_by'])}) "
          f"HGMMA {ops['HGMMA']} QGMMA {ops['QGMMA']} HMMA {ops['HMMA']}")


def main(argv):
  del argv
  version = gpu_static.triton_version()
  if version is None:
    raise app.UsageError("the triton package is missing: pip install -e "
                         "'.[gpu-static]' (a CPU wheel; no GPU needed).")
  cfg = benchmark_gpu.GPUBench()
  run = print_run_info({'bench': 'gpu_static', 'target': 'sm_90a',
                        'triton': version, 'sites': _SITES.value,
                        **dataclasses.asdict(cfg)})
  sites = gpu_static.msa_sites(cfg)
  sites.update(gpu_static.grouped_matmul_sites())
  if _SITES.value:
    sites = {name: site for name, site in sites.items()
             if any(s in name for s in _SITES.value)}
  log = common.progress(_JSON.value)
  rows = gpu_static.report(sites, log=lambda r: log(_line(r)))
  common.finish('gpu_static', run, {'rows': rows,
                                    'summary': gpu_static.summary(rows)},
                subset=bool(_SITES.value))


if __name__ == '__main__':
  app.run(main)
