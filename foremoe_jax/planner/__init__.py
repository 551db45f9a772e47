"""Host-side planners: per-micro-step placements from the foresight (numpy only)."""
