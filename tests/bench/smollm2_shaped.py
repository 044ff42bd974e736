"""Write a SmolLM2-135M-shaped Llama with 8 query / 2 KV heads (so tensor parallelism of 2
divides it) and random bfloat16 weights, for ``brook-engine bench --workload parallel``:
30 layers, hidden 576, MLP 1536, vocabulary 49,152, tied embeddings. The tokenizer is
copied from the SmolLM2 folder the README's demo builds.

    .venv/bin/python tests/bench/smollm2_shaped.py /tmp/smol8 [models/SmolLM2-135M-Instruct]
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import transformers


def main(out: Path, tokenizer_from: Path) -> None:
    settings: dict[str, Any] = {
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 72,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "rope_theta": 100000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # built in bfloat16, as SmolLM2 ships
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings)).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, out / name)


if __name__ == "__main__":
    main(
        Path(sys.argv[1]),
        Path(sys.argv[2] if len(sys.argv) > 2 else "models/SmolLM2-135M-Instruct"),
    )
