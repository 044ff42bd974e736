"""Load a Hugging Face folder's safetensors (single or sharded) into a ``CausalLM``.

q/k/v and gate/up are fused in Brook's layers; the loader copies each checkpoint tensor into
its slice. Under tensor and pipeline parallelism a rank reads only its own slices of its own
stage's tensors (safetensors reads slices without loading the rest). A missing or unexpected
tensor is an error that names it.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from brook_engine.config import ConfigError, EngineConfig
from brook_engine.layers import cpu_fused
from brook_engine.layers.linear import keep_one_row_copies, pack_cpu_weights
from brook_engine.layers.moe import SparseMoE
from brook_engine.layers.tensor_parallel import Shard, TensorComm
from brook_engine.models.arch import ModelArch
from brook_engine.models.llama import CausalLM
from brook_engine.offload.ledger import WeightLedger
from brook_engine.offload.plan import RankPlan
from brook_engine.offload.setup import set_up_offload
from brook_engine.quant import checkpoint as quant_checkpoint
from brook_engine.quant.linear import W8A16, Int8Linear, QuantizedHead
from brook_engine.quant.quantize import QuantizedWeight, quantize

log = logging.getLogger(__name__)

_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
#: An expert's projection: Qwen2/3-MoE's ``mlp.experts.E.gate_proj``, Mixtral's
#: ``block_sparse_moe.experts.E.w1`` (w1 gate, w3 up, w2 down)
_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)$")
_EXPERT_PARTS = {
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",
    "w3": "up",
    "w2": "down",
}


@dataclass(frozen=True)
class Placement:
    """Checkpoint rows (or columns, ``dim=1``) [src_start, src_start + length) go to rows
    [dst_start, …) of parameter ``param``; ``zero`` fills its rows with zeros instead (the
    bias of a row-parallel projection lives on tensor rank 0 only)."""

    param: str
    dst_start: int
    length: int
    dim: int = 0
    src_start: int = 0
    zero: bool = False
    source_rows: int | None = None  # rows the checkpoint tensor must have; None: ``length``


#: A checkpoint tensor this rank does not hold (another stage's).
_ELSEWHERE: list[Placement] = []


def load_model(
    arch: ModelArch,
    folder: Path,
    dtype: torch.dtype,
    device: torch.device,
    shard: Shard,
    comm: TensorComm | None,
    progress: bool,
    weights: str = "none",
    group_size: int | None = None,
    offload: RankPlan | None = None,
    config: EngineConfig | None = None,
) -> tuple[CausalLM, int]:
    """This rank's part of the model, built without memory first, then filled from the
    checkpoint; and the device bytes its weights take (on CPU with the packed copies).

    ``weights`` is ``quantization.weights``: ``w8a16`` quantizes a float checkpoint's
    projections as they are read (one tensor in float at a time) or reads a W8A16
    compressed-tensors checkpoint as it is, and gives the LM head an int8 copy;
    ``group_size`` is ``quantization.groupSize``. ``offload``: this rank's memory plan; its
    streamed pieces are read one at a time into the host pool or the spill file and bound
    to their device slots (``model.streamer``), and the weight ledger holds every device
    allocation to the budget. ``config``: the engine's (its ``moe`` routing, and the offload
    settings)."""
    stored = quant_checkpoint.read_quantization(folder)
    if stored is not None and weights != stored.scheme:
        raise ConfigError(
            f"quantization.weights is {weights!r}, but {folder} holds a {stored.scheme} "
            f"checkpoint ({quant_checkpoint.QUANT_METHOD}, {stored.format}); set "
            f"quantization.weights: {stored.scheme}, or serve the float model"
        )
    int8 = _w8a16(weights, group_size, stored, folder)
    with torch.device("meta"):
        model = CausalLM(arch, dtype, shard, comm, int8, config.moe if config else None)
    ledger = WeightLedger(offload.budget_bytes if offload is not None else None)
    streamed = streamed_modules(model, offload)
    if offload is not None:
        ledger.charge(sum(offload.fixed_bytes.values()), "fixed", "the embedding, head and norms")
        for layer, kind in offload.resident:
            ledger.charge(offload.piece_bytes[kind], "resident", f"layer {layer}'s {kind}")
    for name, module in model.named_modules():
        if not _under(name, streamed):
            module.to_empty(device=device, recurse=False)
    model.tie_embeddings()
    load_weights(model, folder, progress=progress, skip=tuple(f"{s}." for s in streamed))
    model.eval()
    # only a checkpoint whose quantization leaves the head unignored stores it in int8
    head_q = (
        stored_head(model, folder) if int8 is not None and arch.shape.head_stored_int8 else None
    )
    if head_q is not None and not arch.tie_word_embeddings and model.lm_head is not None:
        # an untied head stored in int8 alone: the int8 copy is all it multiplies by
        # (float32 measurements dequantize it), so no float table is kept
        table = model.lm_head.weight
        model.lm_head.weight = nn.Parameter(table.new_empty((0, table.shape[1])), False)
    resident = [p for n, p in model.named_parameters() if not _under(n, streamed)]
    weight_bytes = sum(p.numel() * p.element_size() for p in resident)
    if int8 is not None and model.lm_head is not None:
        head = QuantizedHead(model.lm_head.weight, int8.group_for(arch.hidden_size), head_q)
        model.lm_head.quantized = head
        weight_bytes += head.nbytes()
    if device.type == "cpu":
        weight_bytes += pack_cpu_weights(model)
        weight_bytes += sum(
            m.pack_for_cpu()
            for name, m in model.named_modules()
            if isinstance(m, Int8Linear) and not _under(name, streamed)
        )
    if offload is not None:
        assert config is not None, "offload needs the engine configuration"
        planned = ledger.held
        if weight_bytes > planned:  # the plan undercounted: charge the rest (or refuse)
            ledger.charge(weight_bytes - planned, "resident", "the resident weights as loaded")
        state = set_up_offload(
            model,
            model.model.layers,
            offload,
            config,
            device,
            ledger,
            lambda module, name: _load_piece(model, folder, module, name, device),
            progress,
        )
        model.offload = state
        weight_bytes = ledger.held
    return model, weight_bytes


def streamed_modules(model: CausalLM, offload: RankPlan | None) -> list[str]:
    """Names of the modules whose weights stream (``model.layers.3.mlp``, …)."""
    if offload is None:
        return []
    start = offload.layers[0]
    part = {"attention": "self_attn", "ffn": "mlp"}
    return [f"model.layers.{layer - start}.{part[kind]}" for layer, kind in offload.streamed]


def _under(name: str, prefixes: list[str]) -> bool:
    return any(name.startswith(f"{p}.") or name == p for p in prefixes)


def _load_piece(
    model: CausalLM, folder: Path, module: nn.Module, name: str, device: torch.device
) -> None:
    """Fill one streamed piece in host memory from the checkpoint, in the layout its device
    reads (on CPU, W8A16's tiled copy and Brook's float32 layout)."""
    module.to_empty(device="cpu")
    load_weights(model, folder, progress=False, only=f"{name}.")
    if device.type == "cpu":
        for sub in module.modules():
            if isinstance(sub, Int8Linear):
                sub.pack_for_cpu()
        pack_cpu_weights(module, streamable_only=True)


def _w8a16(
    weights: str,
    group_size: int | None,
    stored: quant_checkpoint.CheckpointQuantization | None,
    folder: Path,
) -> W8A16 | None:
    """The quantization to build: the setting's, checked against a quantized checkpoint."""
    if weights != "w8a16":
        return None
    if stored is None:
        return W8A16(group_size)
    if group_size is not None and group_size != stored.group_size:
        held = (
            "one scale per channel"
            if stored.group_size is None
            else (f"groups of {stored.group_size}")
        )
        raise ConfigError(
            f"quantization.groupSize is {group_size}, but {folder} is quantized with {held}; "
            "leave groupSize unset to use the checkpoint's"
        )
    return W8A16(stored.group_size)


_COPY_TYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_COPIES_OF = {torch.float32: ("fp32",), torch.bfloat16: ("bf16", "fp16")}  # model: copies


def add_one_row_copies(
    model: CausalLM, choice: str, dtype: torch.dtype, device: torch.device
) -> int | None:
    """``shapes.oneRowWeights``: copies of the weights for one-row products (fp32 of a
    float32 model, bf16 or fp16 of a bfloat16 one, on CPU). Returns the bytes they take, or
    None for ``model``; a copy that cannot apply, or a choice that would keep none (every
    weight read as it is already), is a ``ConfigError`` naming the field (never ignored)."""
    if choice == "model":
        return None
    if device.type != "cpu":
        raise ConfigError(
            f"shapes.oneRowWeights {choice}: one-row copies are read by Brook's CPU kernels; "
            f"on {device.type} use model"
        )
    allowed = _COPIES_OF.get(dtype, ())
    if choice not in allowed:
        name = str(dtype).removeprefix("torch.")
        fix = f"use {' or '.join(allowed)} or model" if allowed else "use model"
        raise ConfigError(
            f"shapes.oneRowWeights {choice}: this model runs in {name}, and {choice} copies "
            f"are of {'float32' if choice == 'fp32' else 'bfloat16'} weights; {fix}"
        )
    copy_type = _COPY_TYPES[choice]
    if choice != "fp16" and cpu_fused.one_row_path(dtype, copy_type) is None:
        # Only the kernels read fp32 and bf16 copies: kept without them, they would be memory
        # taken for nothing (fp16 ones fall back to PyTorch's FP16 product).
        raise ConfigError(
            f"shapes.oneRowWeights {choice}: its copies are read by Brook's CPU kernels, which "
            "do not run here (see the log above); use model, or fp16 for a bfloat16 model"
        )
    added = keep_one_row_copies(model, copy_type)
    if added == 0 and not (model.shard.first_stage and model.shard.last_stage):
        # A pipeline stage sees only its layers: another stage (the LM head's) may keep copies.
        log.info("shapes.oneRowWeights %s: this pipeline stage keeps no copy", choice)
    elif added == 0:
        # Every weight is one the one-row products read as it is: the setting would change
        # nothing, and a setting accepted without effect is refused.
        plain = str(copy_type).removeprefix("torch.")
        raise ConfigError(
            f"shapes.oneRowWeights {choice}: this model keeps no copy here; every weight is "
            f"already read as it is by one-row products (plain {plain}, or float32 in Brook's "
            "packed layout); use model"
        )
    return added


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{folder} holds no *.safetensors weights")
    return files


def placements(model: CausalLM, name: str, rows: int) -> list[Placement] | None:
    """Where checkpoint tensor ``name`` (``rows`` long in dimension 0) goes on this rank;
    an empty list when another rank holds it, None when the model has no such tensor."""
    arch, shard = model.arch, model.shard
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        start, end, _ = shard.vocab(arch.vocab_size)
        if name == "lm_head.weight":
            target = "lm_head.weight" if model.lm_head is not None else None
        elif model.model.embed_tokens is not None:
            target = "model.embed_tokens.weight"
        elif arch.tie_word_embeddings and model.lm_head is not None:
            target = "lm_head.weight"  # a last stage of a tied model: the head is the embedding
        else:
            target = None
        place = Placement(target or "", 0, end - start, 0, start, source_rows=arch.vocab_size)
        return [place] if target else _ELSEWHERE
    if name == "model.norm.weight":
        return _replicated(model, name) if model.model.norm is not None else _ELSEWHERE
    layer = _LAYER.match(name)
    if layer is None:
        return None
    index, module, kind = int(layer.group(1)), layer.group(2), layer.group(3)
    end_layer = arch.num_layers if shard.layer_end is None else shard.layer_end
    if not 0 <= index < arch.num_layers:
        return None
    if not shard.layer_start <= index < end_layer:
        return _ELSEWHERE
    prefix = f"model.layers.{index - shard.layer_start}."
    d = arch.head_dim
    h0, h1 = shard.split(arch.num_heads)
    k0, k1 = shard.kv_heads(arch.num_heads, arch.num_kv_heads)
    i0, i1 = shard.split(arch.intermediate_size)
    q_local, kv_local, inter_local = (h1 - h0) * d, (k1 - k0) * d, i1 - i0
    q_all, kv_all = arch.num_heads * d, arch.num_kv_heads * d
    if module == "block_sparse_moe.gate":
        module = "mlp.gate"  # Mixtral's router, where Brook keeps every family's
    expert = _EXPERT.match(module)
    if expert is not None:
        return _expert_placement(
            model, index, prefix, int(expert.group(1)), expert.group(2), kind, rows
        )
    shared = arch.experts.shared_expert_size if arch.experts is not None else 0
    s0, s1 = shard.split(shared)
    column = {  # column-parallel: fused parameter, destination row, source row, rows, of
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, h0 * d, q_local, q_all),
        "self_attn.k_proj": ("self_attn.qkv_proj", q_local, k0 * d, kv_local, kv_all),
        "self_attn.v_proj": ("self_attn.qkv_proj", q_local + kv_local, k0 * d, kv_local, kv_all),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0, i0, inter_local, arch.intermediate_size),
        "mlp.up_proj": ("mlp.gate_up_proj", inter_local, i0, inter_local, arch.intermediate_size),
        "mlp.shared_expert.gate_proj": ("mlp.shared_expert.gate_up_proj", 0, s0, s1 - s0, shared),
        "mlp.shared_expert.up_proj": (
            "mlp.shared_expert.gate_up_proj",
            s1 - s0,
            s0,
            s1 - s0,
            shared,
        ),
    }
    if module in column:
        fused, dst, src, length, total = column[module]
        return [Placement(f"{prefix}{fused}.{kind}", dst, length, 0, src, source_rows=total)]
    row_parallel = {"self_attn.o_proj": h0 * d, "mlp.down_proj": i0}
    if shared:
        row_parallel["mlp.shared_expert.down_proj"] = s0
    if module in row_parallel:
        param = f"{prefix}{module}.{kind}"
        if kind == "bias":
            return [Placement(param, 0, rows, zero=shard.tp_rank != 0)]
        return [Placement(param, 0, rows, 1, row_parallel[module])]
    return _replicated(model, f"{prefix}{module}.{kind}")


def _expert_placement(
    model: CausalLM, index: int, prefix: str, expert: int, part: str, kind: str, rows: int
) -> list[Placement] | None:
    """Where expert ``expert``'s projection ``part`` of layer ``index`` goes: into this
    rank's copy of that expert when it holds it (experts are split whole across tensor
    ranks), nowhere on the others; None where the layer has no such expert."""
    arch = model.arch
    mlp = model.model.layers[index - model.shard.layer_start].mlp
    which = _EXPERT_PARTS.get(part)
    if not isinstance(mlp, SparseMoE) or which is None or arch.experts is None:
        return None
    if not 0 <= expert < arch.experts.num_experts:
        return None
    local = expert - mlp.first_expert
    if not 0 <= local < len(mlp.experts):
        return _ELSEWHERE
    width = arch.experts.expert_size
    target = f"{prefix}mlp.experts.{local}."
    if which == "down":
        return [Placement(f"{target}down_proj.{kind}", 0, rows)]
    start = 0 if which == "gate" else width
    return [Placement(f"{target}gate_up_proj.{kind}", start, width)]


def _replicated(model: CausalLM, param: str) -> list[Placement] | None:
    """A tensor every rank holding it keeps whole (norms): exactly the parameter's rows."""
    try:
        rows = model.get_parameter(param).shape[0]
    except AttributeError:
        return None
    return [Placement(param, 0, rows)]


def _read(f: Any, name: str, place: Placement, width: int) -> torch.Tensor:
    piece = f.get_slice(name)
    start, end = place.src_start, place.src_start + (width if place.dim else place.length)
    return piece[:, start:end] if place.dim == 1 else piece[start:end]  # type: ignore[no-any-return]


def load_weights(
    model: CausalLM,
    folder: Path,
    progress: bool = True,
    skip: tuple[str, ...] = (),
    only: str | None = None,
) -> None:
    """Fill ``model``'s parameters from the checkpoint; those under a ``skip`` prefix are
    left alone, and with ``only`` just the parameters under that prefix are filled (an
    offloaded piece, read on its own)."""

    def wanted(param: str) -> bool:
        return (only is None or param.startswith(only)) and not param.startswith(skip or ("\0",))

    expected = {name for name, _ in model.named_parameters() if wanted(name)}
    filled: dict[str, int] = {}
    quantized_head = False
    files = checkpoint_files(folder)
    with tqdm(total=len(files), desc="Loading weights", unit="file", disable=not progress) as bar:
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    if _IGNORED.match(name) or (
                        name == "lm_head.weight" and model.arch.tie_word_embeddings
                    ):
                        continue
                    canonical, part = _canonical(f, name)
                    if canonical == "lm_head.weight" and part != "float":
                        quantized_head = True  # read whole by ``stored_head``
                        continue
                    if part in ("shape", "zero_point"):
                        _check_aside(f, path, name, part)
                        continue
                    shape = tuple(f.get_slice(name).get_shape())
                    targets = placements(model, canonical, shape[0])
                    if targets is None:
                        raise ConfigError(
                            f"{path.name}: unexpected tensor {name!r} for {model.arch.architecture}"
                        )
                    for place in targets:
                        if not wanted(place.param):
                            continue
                        if part != "float" or _holds_int8(model, place.param):
                            _place_int8(model, f, path, name, part, shape, place, filled)
                        else:
                            _place(model, f, path, name, shape, place, filled)
            bar.update(1)
    if quantized_head and "lm_head.weight" in expected and "lm_head.weight" not in filled:
        # an untied head stored in int8 alone: ``load_model`` drops its float table
        start, end, _ = model.shard.vocab(model.arch.vocab_size)
        filled["lm_head.weight"] = end - start  # the padding is counted below
    if only is None:
        _zero_vocab_padding(model, filled)
    missing = sorted(n for n in expected if filled.get(n, 0) != model.get_parameter(n).shape[0])
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ConfigError(f"{folder}: checkpoint lacks {shown}")


def stored_head(model: CausalLM, folder: Path) -> QuantizedWeight | None:
    """This rank's rows of the checkpoint's int8 LM head (``lm_head.weight_packed`` or an
    int8 ``lm_head.weight``, and ``lm_head.weight_scale``), None where the head is stored
    in float. Rows past the vocabulary (a tensor rank's padding) are zero."""
    if model.lm_head is None:
        return None
    parts: dict[str, torch.Tensor] = {}
    shape: tuple[int, ...] | None = None
    rows: dict[str, int] = {}
    start, end, padded = model.shard.vocab(model.arch.vocab_size)
    for path in checkpoint_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if not name.startswith("lm_head.weight"):
                    continue
                _, part = _canonical(f, name)
                piece = f.get_slice(name)
                if part in ("packed", "int8", "scale"):
                    rows[part] = int(piece.get_shape()[0])
                    parts[part] = piece[start:end]  # this rank's vocabulary rows only
                elif part == "shape":
                    shape = tuple(int(v) for v in f.get_tensor(name).tolist())
    if "scale" not in parts or not ({"packed", "int8"} & parts.keys()):
        if parts:
            raise ConfigError(
                f"{folder}: the LM head is stored quantized but lacks its "
                f"{'weight_scale' if 'scale' not in parts else 'int8 weight'}"
            )
        return None
    hidden, vocab = model.arch.hidden_size, model.arch.vocab_size
    stored = "packed" if "packed" in parts else "int8"
    if (shape is not None and shape != (vocab, hidden)) or set(rows.values()) != {vocab}:
        raise ConfigError(
            f"{folder}: lm_head.weight_{'packed' if stored == 'packed' else ''}"
            f"{'' if stored == 'packed' else '(int8)'} and lm_head.weight_scale hold "
            f"{sorted(set(rows.values()))} rows (weight_shape {shape}); the model's head is "
            f"[{vocab}, {hidden}]: the checkpoint does not match config.json"
        )
    if stored == "packed":
        q = quant_checkpoint.unpack_int8(parts["packed"], hidden)
    else:
        q = parts["int8"]
    scale = parts["scale"].reshape(q.shape[0], -1)
    table = model.lm_head.weight
    local_q = torch.zeros((padded, q.shape[1]), dtype=torch.int8)
    local_scale = torch.ones((padded, scale.shape[1]), dtype=scale.dtype)
    local_q[: end - start] = q
    local_scale[: end - start] = scale
    return QuantizedWeight(local_q.to(table.device), local_scale.to(table.device, table.dtype))


def _canonical(f: Any, name: str) -> tuple[str, str]:
    """A compressed-tensors name of the open checkpoint ``f`` as the float weight it stands
    for, and which part of it: ``x.weight_packed`` → (``x.weight``, ``packed``); an int8
    plain tensor (the int-quantized format's weight) → (name, ``int8``); any other plain
    tensor → (name, ``float``)."""
    base, _, suffix = name.rpartition(".")
    if suffix in quant_checkpoint.PARTS:
        return f"{base}.weight", quant_checkpoint.PARTS[suffix]
    return name, "int8" if f.get_slice(name).get_dtype() == "I8" else "float"


def _holds_int8(model: CausalLM, param: str) -> bool:
    """Whether ``param`` is an ``Int8Linear``'s weight (a float tensor is quantized into it)."""
    try:
        return model.get_parameter(param).dtype == torch.int8
    except AttributeError:
        return False  # ``_place`` names the unexpected tensor


def _check_aside(f: Any, path: Path, name: str, part: str) -> None:
    """``weight_shape`` is read with its ``weight_packed``; a zero point must be zero
    (Brook's W8A16 is symmetric)."""
    if part == "zero_point" and bool(f.get_tensor(name).any()):
        raise ConfigError(
            f"{path.name}: {name!r} is not zero; Brook's W8A16 is symmetric (no zero points)"
        )


def _int8_target(model: CausalLM, path: Path, name: str, place: Placement) -> torch.Tensor:
    param = model.get_parameter(place.param).data
    if param.dtype != torch.int8:
        raise ConfigError(
            f"{path.name}: {name!r} is quantized, but Brook keeps {place.param} in the model "
            "dtype; list that layer in quantization_config.ignore and store it in float"
        )
    return param


def _rows(f: Any, name: str, place: Placement) -> torch.Tensor:
    """The checkpoint rows this placement needs, every column (a row-parallel layer reads
    all of its rows: a scale covers a whole output channel)."""
    piece = f.get_slice(name)
    return piece[place.src_start : place.src_start + place.length] if place.dim == 0 else piece[:]  # type: ignore[no-any-return]


def _fill_int8(
    model: CausalLM,
    place: Placement,
    q: torch.Tensor,
    scale: torch.Tensor | None,
    filled: dict[str, int],
) -> None:
    """Copy int8 rows (and, from a float source, their scales) into an ``Int8Linear``."""
    param = model.get_parameter(place.param).data
    if place.dim == 1:
        full = q.shape[1]
        q = q[:, place.src_start : place.src_start + param.shape[1]]
        if scale is not None:
            scale = _scale_columns(scale, full, place.src_start, param.shape[1])
    param[place.dst_start : place.dst_start + q.shape[0]].copy_(q)
    filled[place.param] = filled.get(place.param, 0) + q.shape[0]
    if scale is not None:
        _fill_scale(model, place, scale, filled)


def _scale_columns(scale: torch.Tensor, width: int, start: int, length: int) -> torch.Tensor:
    """The scales of input columns [start, start + length) of a row-parallel layer ``width``
    wide: all of them for one scale per channel, else the groups those columns cover."""
    groups = scale.shape[1]
    if groups == 1:
        return scale
    size = width // groups
    return scale[:, start // size : (start + length) // size]


def _fill_scale(
    model: CausalLM, place: Placement, scale: torch.Tensor, filled: dict[str, int]
) -> None:
    target = model.get_parameter(f"{place.param}_scale").data
    if scale.shape[1] != target.shape[1]:
        raise ConfigError(
            f"{place.param}: the checkpoint has {scale.shape[1]} scales per output channel "
            f"where this layout needs {target.shape[1]}; the checkpoint does not match its "
            "quantization_config"
        )
    target[place.dst_start : place.dst_start + scale.shape[0]].copy_(scale)
    filled[f"{place.param}_scale"] = filled.get(f"{place.param}_scale", 0) + scale.shape[0]


def _place_int8(
    model: CausalLM,
    f: Any,
    path: Path,
    name: str,
    part: str,
    shape: tuple[int, ...],
    place: Placement,
    filled: dict[str, int],
) -> None:
    """A checkpoint tensor into an ``Int8Linear``: a float weight quantized here, rows at a
    time, or a compressed-tensors tensor (``weight_packed``, an int8 ``weight``,
    ``weight_scale``) as stored. Scales are per output channel (and group), so a
    column-parallel rank's rows quantize alone and a row-parallel rank quantizes whole rows
    before it keeps its columns and their groups: every tensor-parallel layout holds the
    same int8 values."""
    param = _int8_target(model, path, name, place)
    columns = param.shape[1] * (model.shard.tp_size if place.dim == 1 else 1)
    if part == "scale":
        rows = _rows(f, name, place)  # this rank's rows of a column-parallel layer
        scale = rows.reshape(rows.shape[0], -1)
        if place.dim == 1:
            scale = _scale_columns(scale, columns, place.src_start, param.shape[1])
        _fill_scale(model, place, scale, filled)
        return
    words = -(-columns // 4) if part == "packed" else columns
    if len(shape) != 2 or shape[0] != (place.source_rows or place.length) or shape[1] != words:
        raise ConfigError(
            f"{path.name}: tensor {name!r} has shape {shape}, which does not fit parameter "
            f"{place.param} ({columns} input channels); the checkpoint does not match "
            "config.json"
        )
    rows = _rows(f, name, place)
    if part == "float":
        layer = model.get_submodule(place.param.rpartition(".")[0])
        assert isinstance(layer, Int8Linear)
        quantized = quantize(rows, layer.weight_scale.dtype, layer.group_size)
        _fill_int8(model, place, quantized.q, quantized.scale, filled)
    else:
        q = quant_checkpoint.unpack_int8(rows, columns) if part == "packed" else rows
        _fill_int8(model, place, q, None, filled)


def _place(
    model: CausalLM,
    f: Any,
    path: Path,
    name: str,
    shape: tuple[int, ...],
    place: Placement,
    filled: dict[str, int],
) -> None:
    try:
        param = model.get_parameter(place.param).data
    except AttributeError:
        raise ConfigError(
            f"{path.name}: unexpected tensor {name!r} for {model.arch.architecture}"
        ) from None
    if place.zero:
        param.zero_()
        filled[place.param] = filled.get(place.param, 0) + param.shape[0]
        return
    width = param.shape[1] if place.dim == 1 else 0
    rows_ok = shape[0] == (place.source_rows or place.length) and (
        place.dst_start + place.length <= param.shape[0]
    )
    if place.dim == 0:
        rest_ok = shape[1:] == tuple(param.shape[1:])
    else:  # a column slice of a row-parallel weight; the full width is tensor × ours
        rest_ok = len(shape) == 2 and shape[1] == width * model.shard.tp_size
    if not rows_ok or not rest_ok:
        raise ConfigError(
            f"{path.name}: tensor {name!r} has shape {shape}, which does not fit parameter "
            f"{place.param} of shape {tuple(param.shape)}; the checkpoint does not match "
            "config.json"
        )
    param[place.dst_start : place.dst_start + place.length].copy_(_read(f, name, place, width))
    filled[place.param] = filled.get(place.param, 0) + place.length


def _zero_vocab_padding(model: CausalLM, filled: dict[str, int]) -> None:
    """Rows past the vocabulary on the last tensor rank: zero, so they score 0 and are cut."""
    start, end, rows = model.shard.vocab(model.arch.vocab_size)
    pad = rows - (end - start)
    if pad <= 0:
        return
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        try:
            param = model.get_parameter(name)
        except AttributeError:
            continue
        param.data[end - start :].zero_()
        filled[name] = filled.get(name, 0) + pad
