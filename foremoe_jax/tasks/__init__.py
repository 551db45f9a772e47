"""Verifiable tasks: tokenizers, prompts and rewards."""
