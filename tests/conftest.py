"""Markers come from the folder a test lives in: tests/unit → unit, and so on."""

from __future__ import annotations

from pathlib import Path

import pytest

_FOLDERS = ("unit", "integration", "e2e")
_TESTS = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        relative = Path(item.path).relative_to(_TESTS)
        if relative.parts and relative.parts[0] in _FOLDERS:
            item.add_marker(getattr(pytest.mark, relative.parts[0]))


# -- tiny Hugging Face models, built once per session ------------------------------------

_CORPUS = (
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog. "
    "Brook serves large language models on Kubernetes clusters of NPUs. "
    "Continuous batching keeps every device busy; a paged KV cache wastes no memory. "
    "Héllo wörld — naïve café, 東京, emoji 🙂 and numbers 0123456789."
)
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _write_tokenizer(folder: Path, vocab_size: int) -> None:
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "chat_template": _CHAT_TEMPLATE,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )


ARCHITECTURES = {
    # GQA 4:2 with untied embeddings
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"num_attention_heads": 4, "num_key_value_heads": 2},
    ),
    # qkv bias, tied embeddings, GQA 6:2 (odd ratio 3)
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"num_attention_heads": 6, "num_key_value_heads": 2, "tie_word_embeddings": True},
    ),
    # MQA (one KV head), odd head count, sliding window shorter than the tests' sequences
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        {"num_attention_heads": 5, "num_key_value_heads": 1, "sliding_window": 24},
    ),
    # per-head q/k RMSNorm (Qwen3's attention), GQA 4:2
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {"num_attention_heads": 4, "num_key_value_heads": 2},
    ),
    # 4 experts, top-2 renormalized, on every layer
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    # 6 experts top-2 (not renormalized), a gated shared expert, qkv bias; layer 1 dense
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "mlp_only_layers": [1],
            "norm_topk_prob": False,
        },
    ),
    # 8 experts top-2 renormalized, q/k norms
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        },
    ),
}


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """``make_tiny_model("llama", **config overrides) -> Path`` of a random HF model folder
    (float32 safetensors, a trained byte-level BPE tokenizer with a chat template)."""
    import torch
    import transformers

    built: dict[str, Path] = {}

    def make(arch: str, **overrides: object) -> Path:
        key = f"{arch}-{sorted(overrides.items())}"
        if key in built:
            return built[key]
        config_name, model_name, defaults = ARCHITECTURES[arch]
        head_dim = 16
        settings: dict[str, object] = {
            "vocab_size": 320,
            "intermediate_size": 96,
            "num_hidden_layers": 3,
            "max_position_embeddings": 512,
            "eos_token_id": 2,
            "bos_token_id": None,
            "initializer_range": 0.08,
            **defaults,
            **overrides,
        }
        heads = int(settings["num_attention_heads"])  # type: ignore[call-overload]
        settings.setdefault("hidden_size", heads * head_dim)
        settings.setdefault("head_dim", head_dim)
        config = getattr(transformers, config_name)(**settings)
        torch.manual_seed(len(built))
        model = getattr(transformers, model_name)(config).eval()
        # Random init gives near-uniform logits; sharpen them so greedy choices are decisive.
        with torch.no_grad():
            model.lm_head.weight.mul_(4.0)
        folder = tmp_path_factory.mktemp(f"{arch}-model")
        model.save_pretrained(folder)
        _write_tokenizer(folder, int(settings["vocab_size"]))  # type: ignore[call-overload]
        built[key] = folder
        return folder

    return make
