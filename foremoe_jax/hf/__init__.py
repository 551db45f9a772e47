"""Hugging Face checkpoints (Qwen3-MoE, Mixtral, OLMoE) in and out of our model.

At the model's edge, beside the trainer: `import_hf` / `load_into` turn a
HF directory (config.json + safetensors, one file or sharded) into our model
config and float32 parameter state; `export_hf` writes them back;
`workdir.py` holds the bodies of experiments/convert_hf.py, hf_forward.py and
export_hf.py. Modules: families.py (the families and config mapping),
tensors.py (tensor names and layouts), files.py (safetensors I/O),
convert.py (whole checkpoints), workdir.py (orbax workdirs), msa_init.py
(an MSA layer's index branch from its dense weights, when the checkpoint has
none).
"""
from foremoe_jax.hf.convert import (export_hf, forward_logits, import_hf,
                                    load_into, missing_index_layers,
                                    model_config_from_hf, place_like)
from foremoe_jax.hf.families import FAMILIES, HFCheckpointError
