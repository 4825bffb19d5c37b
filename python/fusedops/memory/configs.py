"""Llama-style model configs written out here (nothing is downloaded), and a random-init builder.

    tiny      hidden 128, 2 layers, vocab 1024: runs on a CPU in well under a second per step
    small     hidden 1024, 8 layers, vocab 32000 (~150M parameters): a few seconds on a GPU
    llama-1b  the shape of Llama-3.2-1B: hidden 2048, 16 layers, 32 query / 8 key-value heads
              of 64, intermediate 8192, vocab 128256, tied embeddings (1.24B parameters)

`model_config(name)` also takes the path of a JSON file with the same keys (a transformers
config.json works).
"""

from __future__ import annotations

import json
import os

CONFIGS = {
    "tiny": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1024,
                 tie_word_embeddings=True, max_position_embeddings=4096, rms_norm_eps=1e-5,
                 rope_theta=10000.0),
    "small": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=4, head_dim=64, vocab_size=32000,
                  tie_word_embeddings=False, max_position_embeddings=8192, rms_norm_eps=1e-5,
                  rope_theta=500000.0),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                     vocab_size=128256, tie_word_embeddings=True,
                     max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0),
}


def model_config(name: str) -> dict:
    """The config dict of a named model ("tiny", "small", "llama-1b") or of a JSON file."""
    if name in CONFIGS:
        return dict(CONFIGS[name])
    if os.path.isfile(name):
        with open(name) as f:
            return json.load(f)
    raise ValueError(f"unknown model {name!r}: one of {sorted(CONFIGS)} or a config .json file")


def llama_config(cfg: dict, *, attn_implementation: str = "sdpa"):
    """A transformers LlamaConfig from a config dict (use_cache off: this is for training)."""
    from transformers import LlamaConfig

    cfg = dict(cfg)
    theta = cfg.pop("rope_theta", None)
    for key in ("architectures", "model_type", "torch_dtype", "dtype", "transformers_version"):
        cfg.pop(key, None)
    if theta is not None and "rope_parameters" not in cfg:
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": float(theta)}
    cfg["use_cache"] = False
    return LlamaConfig(**cfg, attn_implementation=attn_implementation)


def build_llama(cfg: dict, *, dtype=None, device=None, attn_implementation: str = "sdpa",
                seed: int = 0):
    """A randomly initialised transformers LlamaForCausalLM (the same weights for the same seed
    and device), in training mode; initialised on `device` directly (fast on a GPU)."""
    import torch
    from transformers import LlamaForCausalLM

    config = llama_config(cfg, attn_implementation=attn_implementation)
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        model = LlamaForCausalLM(config)
    if dtype is not None:
        model = model.to(dtype=dtype)
    return model.train()
