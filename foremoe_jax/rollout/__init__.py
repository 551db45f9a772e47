"""Sampling phase: KV-cache decode that records the routing foresight."""
