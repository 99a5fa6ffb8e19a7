"""A tiny Llama for demos: ``config.json`` plus seeded random weights, no download.

``vllm serve`` on a CPU needs a model; this one has two layers of width 128, so it
loads in seconds, and its random weights make greedy outputs depend on the prompt
(enough to see a stale KV read change an answer). The weights are written in the
safetensors format by hand (an 8-byte header length, a JSON header of names,
dtypes, shapes and byte ranges, then the raw little-endian data), so ``.venv``
needs no ``safetensors`` package; vLLM's own loader reads the file
(``tests/test_demo.py`` checks it with the safetensors package too).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from kvmetrics.metrics.files import write_file

TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def tiny_llama_tensors(seed: int = 0) -> dict[str, Any]:
    """The weights, drawn in a fixed order from one seeded generator."""
    import torch

    c = TINY_LLAMA
    hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    heads, kv_heads, head_dim = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * scale

    tensors = {"model.embed_tokens.weight": rand(vocab, hidden, scale=1.0),
               "model.norm.weight": torch.ones(hidden),
               "lm_head.weight": rand(vocab, hidden, scale=hidden ** -0.5)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden, scale=hidden ** -0.5),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden,
                                                scale=hidden ** -0.5),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden,
                                                scale=hidden ** -0.5),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim,
                                                scale=(heads * head_dim) ** -0.5),
            p + "mlp.gate_proj.weight": rand(inter, hidden, scale=hidden ** -0.5),
            p + "mlp.up_proj.weight": rand(inter, hidden, scale=hidden ** -0.5),
            p + "mlp.down_proj.weight": rand(hidden, inter, scale=inter ** -0.5),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        })
    return tensors


def write_safetensors(tensors: dict[str, Any], path: Path) -> None:
    """float32 tensors in the safetensors layout (header padded to 8 bytes)."""
    header: dict[str, Any] = {}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        data = tensors[name].contiguous().to("cpu").numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    # The safe writer (a few MB): no predictable temp name, no device replaced.
    write_file(str(path), b"".join([struct.pack("<Q", len(head)), head, *blobs]))


def write_tiny_llama(folder: Path, seed: int = 0) -> Path:
    """``config.json`` and ``model.safetensors`` in ``folder`` (kept if already there)."""
    folder.mkdir(parents=True, exist_ok=True)
    write_file(str(folder / "config.json"), json.dumps(TINY_LLAMA, indent=1))
    weights = folder / "model.safetensors"
    if not weights.exists():
        write_safetensors(tiny_llama_tensors(seed), weights)
    return folder
