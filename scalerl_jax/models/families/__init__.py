"""Model families by name: one module each (`llama3.py`, `llama4.py`), with its HF mapping.

`ModelConfig.family` names a registered `Family`: what the model code and the HF converters ask
of a family (rotary layout, NoPE / chunked-attention layers, MoE allowed, HF class and field
names, its config.json fields). A new family: its module here (a `Family` and `register(...)`)
and its import in this `__init__`; models/config.py, hf_io.py, layers.py, transformer.py and
testing.py never name a family.
"""
from __future__ import annotations

from scalerl_jax.models.families import llama3, llama4  # noqa: F401 (each registers its family)
from scalerl_jax.models.families.base import (Family, decoder_config, get, names, of_hf_model_type,
                                              register)

__all__ = ["Family", "decoder_config", "get", "names", "of_hf_model_type", "register"]
