"""A single sequence's decode step on CPU, a decoder layer per call into Brook's kernels.

One token through a layer is about ten small kernels (norm, four products, rotary, the KV
write, attention, the activation); between them Python and PyTorch's dispatch cost as much
as the kernels' work at this size. ``csrc/decode_layer.c`` runs the same kernels in the same
order with the same roundings, so its outputs are the Python path's bit for bit (tests hold
them to it). It applies where a layer is one it can run: 16-bit weights it reads plain (the
model's, or ``shapes.oneRowWeights`` copies), float32 weights in Brook's packed layout or
plain copies, W8A16's tiled int8 weights, a KV cache that stores keys and values in the
model's type (no scales, shift or INT8 encoding), one process (no tensor parallelism). Any
other layer, and every step with more than one token, takes the Python path, layer by layer.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from brook_engine.kv.cache import LayerKVCache
from brook_engine.layers import cpu_fused, cpu_kernels, cpu_matmul
from brook_engine.layers.attention import AttentionMetadata
from brook_engine.layers.linear import Linear
from brook_engine.quant import cpu_int8
from brook_engine.quant.linear import Int8Linear

_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class _Product(ctypes.Structure):
    _fields_ = [("weight", _P), ("bias", _P), ("scales", _P), ("group", _I64), ("kind", _I32)]


_INT8 = 3  # the product kind of W8A16's tiled int8 weights (16-bit ones: their _KINDS)
_F32_PACKED = 4  # float32 weights in Brook's packed layout (layers/cpu_matmul.py)


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _P),
        ("post_norm", _P),
        *((name, _Product) for name in ("qkv", "o", "gate_up", "down")),
        ("k_cache", _P),
        ("v_cache", _P),
        *((name, _I64) for name in ("hidden", "heads", "kv_heads", "dim", "inter", "slots")),
        ("block_size", _I64),
        ("eps", _F32),
        ("scale", _F32),
    ]


class _Scratch(ctypes.Structure):
    _fields_ = [
        (name, _P) for name in ("normed", "qkv", "attn", "o", "gate_up", "act", "q32", "attn32")
    ]


def _declare(lib: ctypes.CDLL) -> Any:
    fn = getattr(lib, "brook_decode_row_layer", None)
    if fn is not None:
        ptr = ctypes.POINTER
        fn.restype = ctypes.c_int
        fn.argtypes = [ptr(_Layer), ptr(_Scratch), *([_P] * 9), _I64, _I64, ctypes.c_int, _P]
        fn.argtypes += [ctypes.c_int]
    return fn


def _product(linear: object, dtype: torch.dtype) -> tuple[_Product, list[torch.Tensor]] | None:
    """What the kernel reads for ``linear`` (and the tensors it points into): its plain
    weight or copy, its float32 weight in Brook's packed layout, or W8A16's tiled int8
    weight; None where it is none of these."""
    if type(linear) is Int8Linear:
        tiled = linear.tiled
        if tiled is None or dtype not in (torch.float32, torch.bfloat16):
            return None  # float16 activations are widened in PyTorch on the Python path
        bias = tiled.bias
        product = _Product(
            tiled.packed.data_ptr(),
            None if bias is None else bias.data_ptr(),
            tiled.scales.data_ptr(),
            tiled.group_size,
            _INT8,
        )
        return product, [t for t in (tiled.packed, tiled.scales, bias) if t is not None]
    if type(linear) is not Linear:
        return None
    weight = linear.one_row if linear.one_row is not None else linear.weight
    bias = linear.bias
    if cpu_matmul.is_packed(weight):  # what the Python path multiplies by too
        if dtype != torch.float32:
            return None
        if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
            return None
        ptr = None if bias is None else bias.data_ptr()
        return _Product(weight.data_ptr(), ptr, None, 0, _F32_PACKED), [
            t for t in (weight, bias) if t is not None
        ]
    if weight.is_mkldnn or weight.dtype not in cpu_fused.ONE_ROW_WEIGHTS or weight.dim() != 2:
        return None
    if not weight.is_contiguous() or weight.device.type != "cpu":
        return None
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
        return None
    kind = cpu_fused.ONE_ROW_WEIGHTS[weight.dtype]
    product = _Product(weight.data_ptr(), None if bias is None else bias.data_ptr(), None, 0, kind)
    return product, [weight] if bias is None else [weight, bias]


class RowDecoding:
    """The per-layer plans of one model (built at a layer's first single-token step, rebuilt
    when its weights or cache change) and the scratch its layers share."""

    def __init__(self) -> None:
        self._plans: dict[int, tuple[tuple[int, ...], _Layer | None, list[torch.Tensor]]] = {}
        self._scratch: tuple[tuple[int, ...], _Scratch, list[torch.Tensor]] | None = None
        self._fn: Any = None
        self._lib: ctypes.CDLL | None = None

    def forget(self) -> None:
        """Drop every layer's plan (and the tensors it keeps alive): weights or caches were
        moved in place, keeping the objects a plan's key is made of."""
        self._plans.clear()

    def begin(
        self, x: torch.Tensor, meta: AttentionMetadata, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> RowStep | None:
        """The step's shared arguments when it is one token of one decoding sequence on a
        CPU with the kernels; None where the Python path runs."""
        if x.shape[0] != 1 or meta.num_decodes != 1 or meta.prefills:
            return None
        if meta.decode_lens is None or meta.decode_blocks is None:
            return None
        if x.device.type != "cpu" or x.dtype not in _KINDS:
            return None
        lib = cpu_kernels.library()
        if lib is None:
            return None
        if lib is not self._lib:
            self._lib, self._fn, self._plans = lib, _declare(lib), {}
        if self._fn is None:
            return None
        weights = (torch.float32, torch.bfloat16, torch.float16)  # in the order of their kinds
        paths = [cpu_fused.one_row_path(x.dtype, w) for w in weights]
        if None in paths:
            return None
        paths.append(cpu_int8.isa(lib))
        paths.append(cpu_matmul.isa())
        cos, sin = cos_sin
        tensors = (meta.slot_mapping, meta.decode_blocks, meta.decode_lens)
        if any(t.dtype != torch.int64 or not t.is_contiguous() for t in tensors):
            return None
        if not (cos.is_contiguous() and sin.is_contiguous()) or cos.dtype != x.dtype:
            return None
        isas = (ctypes.c_int * 5)(*(int(p) for p in paths if p is not None))
        return RowStep(self, x.dtype, meta, cos, sin, isas, torch.get_num_threads())

    def plan(self, layer: Any, cache: LayerKVCache, dtype: torch.dtype) -> _Layer | None:
        """The C description of ``layer`` with ``cache``, or None where it takes the Python
        path; cached while the objects it points into are the same."""
        # Checked every step, so read without nn.Module's attribute fallback (dict lookups):
        # submodules and parameters from their dicts, a linear's copies (plain attributes)
        # from its own.
        if not layer.__dict__.get("row_kernel", True):
            return None  # an expert block, or Qwen3's q/k norms: the Python path
        sub = layer._modules
        attn, mlp = sub["self_attn"]._modules, sub["mlp"]._modules
        modules = (attn["qkv_proj"], attn["o_proj"], mlp["gate_up_proj"], mlp["down_proj"])
        norms = (sub["input_layernorm"], sub["post_attention_layernorm"])
        key = (
            id(cache.k),
            id(cache.v),
            id(cache.k_shift),  # an encoding set on a live cache sends it to the Python path
            id(cache.int8),
            id(cache.k_scale),
            *(id(n._parameters["weight"]) for n in norms),
            *(id(m._parameters.get("weight")) for m in modules),
            *(id(m.__dict__.get("one_row")) for m in modules),
            *(id(m.__dict__.get("tiled")) for m in modules),
        )
        held = self._plans.get(id(layer))
        if held is not None and held[0] == key:
            return held[1]
        built = self._build(layer, cache, dtype, modules)
        self._plans[id(layer)] = (key, *built)
        return built[0]

    def _build(
        self, layer: Any, cache: LayerKVCache, dtype: torch.dtype, modules: tuple[Any, ...]
    ) -> tuple[_Layer | None, list[torch.Tensor]]:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.comm is not None or mlp.comm is not None:
            return None, []
        if cache.k_shift is not None or cache.int8 is not None or cache.k_scale is not None:
            return None, []
        if cache.k.dtype != dtype or not (cache.k.is_contiguous() and cache.v.is_contiguous()):
            return None, []
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if any(n.dtype != dtype or not n.is_contiguous() for n in norms):
            return None, []
        products = [_product(m, dtype) for m in modules]
        if any(p is None for p in products):
            return None, []
        keep = [*norms, cache.k, cache.v]
        fields: dict[str, Any] = {
            "input_norm": norms[0].data_ptr(),
            "post_norm": norms[1].data_ptr(),
            "k_cache": cache.k.data_ptr(),
            "v_cache": cache.v.data_ptr(),
            "hidden": norms[0].shape[0],
            "heads": attn.num_heads,
            "kv_heads": attn.num_kv_heads,
            "dim": attn.head_dim,
            "inter": mlp.intermediate,
            "slots": cache.k.shape[1],
            "block_size": cache.block_size,
            "eps": layer.input_layernorm.eps,
            "scale": attn.scale,
        }
        if layer.post_attention_layernorm.eps != layer.input_layernorm.eps:
            return None, []
        for name, held in zip(("qkv", "o", "gate_up", "down"), products, strict=True):
            assert held is not None
            fields[name], tensors = held
            keep += tensors
        return _Layer(**fields), keep

    def scratch(self, layer: _Layer, dtype: torch.dtype) -> _Scratch:
        """Scratch for ``layer``'s kernels, shared by every layer of the model."""
        heads, dim = layer.heads, layer.dim
        sizes = (
            layer.hidden,
            (heads + 2 * layer.kv_heads) * dim,
            heads * dim,
            layer.hidden,
            2 * layer.inter,
            layer.inter,
        )
        key = (*sizes, heads * dim, _KINDS[dtype])
        if self._scratch is None or self._scratch[0] != key:
            tensors = [torch.empty(n, dtype=dtype) for n in sizes]
            tensors += [torch.empty(heads * dim, dtype=torch.float32) for _ in range(2)]
            self._scratch = (key, _Scratch(*(t.data_ptr() for t in tensors)), tensors)
        return self._scratch[1]


class RowStep:
    """One single-token step's arguments, shared by its layers."""

    def __init__(
        self,
        owner: RowDecoding,
        dtype: torch.dtype,
        meta: AttentionMetadata,
        cos: torch.Tensor,
        sin: torch.Tensor,
        isas: ctypes.Array[ctypes.c_int],
        threads: int,
    ) -> None:
        assert meta.decode_blocks is not None and meta.decode_lens is not None
        self.owner, self.dtype, self.meta = owner, dtype, meta
        self.cos, self.sin, self.threads = cos, sin, threads
        self.isas, self.isas_ptr = isas, ctypes.cast(isas, ctypes.c_void_p)
        self.width = meta.decode_blocks.shape[1]
        self.window = meta.sliding_window or 0

    def covers(self, layers: Any, caches: list[LayerKVCache]) -> bool:
        """Whether every one of ``layers`` runs as one kernel call (compile mode runs a
        step the kernel covers this way: a graph cannot beat one call per layer)."""
        plan = self.owner.plan
        return all(
            plan(la, c, self.dtype) is not None for la, c in zip(layers, caches, strict=True)
        )

    def layer(
        self, layer: Any, cache: LayerKVCache, x: torch.Tensor, delta: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``layer(x, delta, ...)`` for this token: (residual stream, MLP output), or None
        where the layer takes the Python path."""
        plan = self.owner.plan(layer, cache, self.dtype)
        if plan is None or x.dtype != self.dtype or not x.is_contiguous():
            return None
        if delta is not None and (delta.dtype != self.dtype or not delta.is_contiguous()):
            return None
        scratch = self.owner.scratch(plan, self.dtype)
        residual, out = torch.empty_like(x), torch.empty_like(x)
        meta = self.meta
        assert meta.decode_blocks is not None and meta.decode_lens is not None
        status = self.owner._fn(
            ctypes.byref(plan),
            ctypes.byref(scratch),
            x.data_ptr(),
            None if delta is None else delta.data_ptr(),
            residual.data_ptr(),
            out.data_ptr(),
            self.cos.data_ptr(),
            self.sin.data_ptr(),
            meta.slot_mapping.data_ptr(),
            meta.decode_blocks.data_ptr(),
            meta.decode_lens.data_ptr(),
            self.width,
            self.window,
            _KINDS[self.dtype],
            self.isas_ptr,
            self.threads,
        )
        if status != 0:
            raise RuntimeError(
                "decode layer kernel failed: a KV slot outside the cache or no memory"
            )
        return residual, out
