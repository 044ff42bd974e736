"""Write a random Llama-shaped model of 1.03 GiB in bfloat16 (554 M parameters: hidden
1,536, MLP 4,096, 16 layers, vocabulary 49,152) with SmolLM2's tokenizer, for figures on a
model larger than SmolLM2. Random weights: its tokens mean nothing, its speed is real.

``python tests/bench/random_model.py OUTPUT_DIR``"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
import transformers

SHAPE = {
    "hidden_size": 1536,
    "intermediate_size": 4096,
    "num_hidden_layers": 16,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "vocab_size": 49152,  # the tokenizer's (SmolLM2's): its ids must all be rows
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def main() -> None:
    out = Path(sys.argv[1])
    tokenizer_from = Path("models/SmolLM2-135M-Instruct")
    config = transformers.LlamaConfig(**SHAPE, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, out / name)
    params = sum(p.numel() for p in model.parameters())
    print(f"{out}: {params / 1e6:.0f} M parameters, {params * 2 / 2**30:.2f} GiB in bfloat16")


if __name__ == "__main__":
    main()
