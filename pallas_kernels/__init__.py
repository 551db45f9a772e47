"""Pallas kernels, each beside its pure-jnp reference."""
