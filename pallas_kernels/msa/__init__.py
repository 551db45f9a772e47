"""MiniMax Sparse Attention (MSA, arXiv 2606.13392): docs/design.md §6.

A small index branch scores key blocks per GQA group and keeps the top-k
blocks per query; the main branch is exact softmax attention over them.

Modules: `reference` (pure jnp, dense and masked), `xla` (the fast CPU path,
key-centric), the Pallas kernels `select_kernel` (a), `forward_kernel` (b),
`backward_kernel` (c), `decode_kernel` (d) with their glue in `pallas_path`,
`indexer_loss` (the KL that trains the indexer), and `api`, which the model
calls.
"""
from pallas_kernels.msa.api import GPU_KERNELS
from pallas_kernels.msa.api import decode_cache_len
from pallas_kernels.msa.api import msa_attention
from pallas_kernels.msa.api import msa_decode
from pallas_kernels.msa.api import msa_indexer_kl_loss
from pallas_kernels.msa.api import resolve_impl

__all__ = ['GPU_KERNELS', 'decode_cache_len', 'msa_attention', 'msa_decode',
           'msa_indexer_kl_loss', 'resolve_impl']
