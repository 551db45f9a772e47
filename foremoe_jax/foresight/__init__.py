"""Foresight: exact per-micro-step expert loads from routing records; traces."""
