"""MoE decoder LM in Flax NNX, with placement-aware expert parallelism."""
