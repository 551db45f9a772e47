"""MiniMax Sparse Attention (MSA): reference, CPU XLA path and Pallas kernels."""
