"""Verifiable tasks: tokenizers, prompts and rewards."""
from foremoe_jax.tasks.base import Task
from foremoe_jax.tasks.registry import get_task, task_from_config, task_names
from foremoe_jax.tasks.tokenizer import BOS_ID, EOS_ID, PAD_ID, CharTokenizer
