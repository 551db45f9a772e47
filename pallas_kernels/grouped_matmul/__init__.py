"""Grouped matmul over row tiles of one slot each (the MoE layer's expert
matmuls on a GPU): reference.py (pure jnp, the spec) and kernel.py (Pallas
Triton kernels with their VJP; the reference where not compiled for a
CUDA GPU)."""
from pallas_kernels.grouped_matmul.kernel import grouped_matmul
from pallas_kernels.grouped_matmul.kernel import slot_matmul_t
from pallas_kernels.grouped_matmul.kernel import swiglu
from pallas_kernels.grouped_matmul.kernel import tile_matmul

__all__ = ['grouped_matmul', 'slot_matmul_t', 'swiglu', 'tile_matmul']
