"""The KV-cache tensors: one pair per layer, each stored in the dtype its layer policy names.

Slots are flat (``block * block_size + offset``); the block manager hands out blocks, the
runner turns block tables into slot indexes. Storage is head-major ([kv_heads, slots,
head_dim]), so the blocks of many sequences gather into the layout batched matmuls per head
want. FP8 E4M3 keeps a float32 scale per token and KV head (amax / 448), so a value never
saturates; FP8 E5M2 has the range to go without one.

INT8 (the KV format Ascend NPUs store natively) has no per-token scale at all: keys and
values are stored minus their per-head calibration mean, turned by an orthogonal matrix
(Hadamard) that spreads outlier channels over all of them, and rounded against fixed
per-channel scales from the calibration pass (``Int8Params``). Attention never undoes the
transform on the cache: the query is turned and scaled instead (a score moves by the same
``q·mean`` for every key, which softmax ignores), and the output is turned back and the value
mean added (the probabilities sum to one) — a cost per query token, not per cached one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from brook_engine.config import KVDType
from brook_engine.config.kv_cache import kv_bytes_per_token

_FP8_E4M3_MAX = 448.0
_INT8_MAX = 127.0
_LOG_BALANCE = math.log(16.0)  # INT8 key channel weights stay within [1/16, 16]
_STORAGE = {
    "int8": torch.int8,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e5m2": torch.float8_e5m2,
    "fp8_e4m3": torch.float8_e4m3fn,
}


def storage_dtype(kind: KVDType, compute_dtype: torch.dtype) -> torch.dtype:
    return compute_dtype if kind == "auto" else _STORAGE[kind]


def rotation(dim: int) -> torch.Tensor:
    """An orthogonal [dim, dim] float32 matrix that mixes every channel into every other:
    the normalized Hadamard matrix when ``dim`` is a power of two, else a fixed random
    orthogonal one (the same on every rank and every start)."""
    if dim & (dim - 1) == 0:
        h = torch.ones(1, 1)
        while h.shape[0] < dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return h / math.sqrt(dim)
    gen = torch.Generator().manual_seed(0)
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64))
    turned: torch.Tensor = (q * torch.sign(torch.diagonal(r))).float()
    return turned


@dataclass(frozen=True)
class Int8Params:
    """What an INT8 layer stores against, fitted on calibration keys and values."""

    rotation: torch.Tensor  # [head_dim, head_dim] float32, orthogonal
    k_mean: torch.Tensor  # [kv_heads, head_dim] float32
    v_mean: torch.Tensor
    k_scale: torch.Tensor  # [kv_heads, head_dim] float32, per channel of the turned basis
    v_scale: torch.Tensor
    # [kv_heads, head_dim] float32: key channel c is stored times k_balance[c] and the query
    # divided by it (scores unchanged), so channels that queries weigh heavily are rounded
    # more finely.
    k_balance: torch.Tensor

    @classmethod
    def fit(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Int8Params:
        """From calibration queries [tokens, heads, head_dim], keys and values
        [tokens, kv_heads, head_dim]: each channel's scale maps the largest value seen to 127
        (larger ones later saturate). A score's rounding error is q·Δk; with key channels
        weighed by (E[q_c²] / E[k_c²])^¼ it is smallest for a given number of levels (the two
        sides' energies balance, channel by channel)."""
        rot = rotation(k.shape[-1]).to(k.device)
        k32, v32 = k.float(), v.float()
        k_mean, v_mean = k32.mean(dim=0), v32.mean(dim=0)
        kv_heads, dim = k.shape[1], k.shape[2]
        q_energy = q.float().view(q.shape[0], kv_heads, -1, dim).pow(2).mean(dim=(0, 2))
        k_energy = (k32 - k_mean).pow(2).mean(dim=0)
        # In logs, bounded before centring so one dead channel cannot skew the others.
        log_ratio = (q_energy.clamp_min(1e-12) / k_energy.clamp_min(1e-12)).log() / 4
        log_balance = log_ratio.clamp(-_LOG_BALANCE, _LOG_BALANCE)
        log_balance = log_balance - log_balance.mean(dim=-1, keepdim=True)
        balance = log_balance.clamp(-_LOG_BALANCE, _LOG_BALANCE).exp()

        def scale(x: torch.Tensor, mean: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            amax = (((x - mean) * weight) @ rot).abs().amax(dim=0)
            return (amax / _INT8_MAX).clamp_min(1e-8)

        return cls(
            rot,
            k_mean,
            v_mean,
            scale(k32, k_mean, balance),
            scale(v32, v_mean, torch.ones_like(v_mean)),
            balance,
        )

    # Each transform below is one batched product with its maps folded once (centre,
    # balance, rotate and scale in a [head_dim, head_dim] matrix and an offset): a decode
    # step runs them in every INT8 layer, where a chain of small ops per call cost more than
    # the attention itself. Keys and values are mapped per KV head; the query and the output
    # per query head (a GQA group's heads hold copies of their KV head's map: regrouping the
    # heads on every call cost more than the product), 8 · heads · head_dim² bytes a layer.
    # Centring after the product (x·M - mean·M) rounds a little differently from before it
    # where keys sit far from zero; it is float32 throughout, never a reduced-precision
    # matmul mode.

    def __post_init__(self) -> None:
        object.__setattr__(self, "_folded", {})  # maps by purpose and head count

    def maps(self, name: str, heads: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(matrix [n, head_dim, head_dim], offset [n, 1, head_dim] or None) of ``name``:
        keys and values per KV head (n = kv_heads; also read by the CPU kernel that stores
        INT8 rows), query and output per query head (n = ``heads``). Contiguous float32,
        folded at the first call."""
        folded: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor | None]]
        folded = self.__dict__["_folded"]
        maps = folded.get((name, heads))
        if maps is None:
            matrix, offset = self._fold(name)
            if name in ("query", "output"):
                group = heads // self.k_scale.shape[0]
                matrix = matrix.repeat_interleave(group, dim=0)
                offset = None if offset is None else offset.repeat_interleave(group, dim=0)
            maps = (matrix.contiguous(), None if offset is None else offset.contiguous())
            folded[(name, heads)] = maps
        return maps

    def _fold(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per KV head."""
        rot = self.rotation
        if name == "keys":  # ((k - mean) * balance) @ R / scale
            matrix = self.k_balance[:, :, None] * rot / self.k_scale[:, None, :]
            return matrix, ((self.k_mean * self.k_balance) @ rot / self.k_scale)[:, None, :]
        if name == "values":  # (v - mean) @ R / scale
            return rot / self.v_scale[:, None, :], (self.v_mean @ rot / self.v_scale)[:, None, :]
        if name == "query":  # (q / balance) @ R * scale
            return rot / self.k_balance[:, :, None] * self.k_scale[:, None, :], None
        # output: (out * scale) @ R^T + mean
        return self.v_scale[:, :, None] * rot.T, self.v_mean[:, None, :]

    def quantize_keys(self, k: torch.Tensor) -> torch.Tensor:
        """k [kv_heads, tokens, head_dim] → int8 of the same shape."""
        return self._quantize(k, "keys")

    def quantize_values(self, v: torch.Tensor) -> torch.Tensor:
        return self._quantize(v, "values")

    def _quantize(self, x: torch.Tensor, name: str) -> torch.Tensor:
        matrix, offset = self.maps(name)
        assert offset is not None
        turned = torch.baddbmm(offset, x.float(), matrix, beta=-1)
        return turned.round_().clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)

    # Attention over INT8 layers runs in float32 (integers up to 127 and the turned query
    # are exact there): rounding the turned query or the integer-domain output to a 16-bit
    # dtype would add a second error on top of the quantization's.

    def query(self, q: torch.Tensor) -> torch.Tensor:
        """q [tokens, heads, head_dim] → the float32 query that scores the stored integers
        (contiguous)."""
        matrix, _ = self.maps("query", q.shape[1])
        return torch.bmm(q.float().transpose(0, 1), matrix).transpose(0, 1).contiguous()

    def output(self, out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Float32 attention output over stored integers [tokens, heads, head_dim] → the
        output over the values they stand for, in ``dtype`` (contiguous)."""
        matrix, mean = self.maps("output", out.shape[1])
        assert mean is not None
        turned = torch.baddbmm(mean, out.float().transpose(0, 1), matrix)
        return turned.transpose(0, 1).contiguous().to(dtype)


def bytes_per_token(kind: KVDType, compute_dtype: torch.dtype, kv_heads: int, head_dim: int) -> int:
    """KV bytes one token takes in one layer (keys and values, scales included)."""
    return kv_bytes_per_token(kind, compute_dtype.itemsize, kv_heads, head_dim)


@dataclass
class LayerKVCache:
    k: torch.Tensor  # [kv_heads, slots, head_dim]
    v: torch.Tensor
    kind: KVDType
    compute_dtype: torch.dtype
    block_size: int
    k_scale: torch.Tensor | None = None  # [kv_heads, slots, 1], FP8 E4M3 only
    v_scale: torch.Tensor | None = None
    # Subtracted from every key before it is stored, [kv_heads, head_dim] in the compute
    # dtype. Attention is unchanged: a query's scores all move by q·shift, which softmax
    # ignores. The stored keys are smaller, so low precision rounds them less (calibration
    # sets it for the layers where it helps).
    k_shift: torch.Tensor | None = None
    int8: Int8Params | None = None  # INT8 only, set by calibration before the first write

    @classmethod
    def allocate(
        cls,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        kind: KVDType,
        compute_dtype: torch.dtype,
        device: torch.device,
    ) -> LayerKVCache:
        dtype = storage_dtype(kind, compute_dtype)
        num_slots = num_blocks * block_size
        shape = (kv_heads, num_slots, head_dim)
        cache = cls(
            k=torch.zeros(shape, dtype=dtype, device=device),
            v=torch.zeros(shape, dtype=dtype, device=device),
            kind=kind,
            compute_dtype=compute_dtype,
            block_size=block_size,
        )
        if kind == "fp8_e4m3":
            scale_shape = (kv_heads, num_slots, 1)
            cache.k_scale = torch.ones(scale_shape, dtype=torch.float32, device=device)
            cache.v_scale = torch.ones(scale_shape, dtype=torch.float32, device=device)
        return cache

    def resize(self, num_blocks: int) -> None:
        """Hold ``num_blocks`` blocks: the slots kept are copied, new ones are empty (weight
        offload's adaptive policy grows the cache into memory freed by weights)."""
        slots = num_blocks * self.block_size

        def resized(t: torch.Tensor, fill: float) -> torch.Tensor:
            out = torch.full((t.shape[0], slots, t.shape[2]), fill, dtype=t.dtype, device=t.device)
            keep = min(slots, t.shape[1])
            out[:, :keep].copy_(t[:, :keep])
            return out

        # one tensor at a time: the old one is freed before the next is allocated
        self.k = resized(self.k, 0)
        self.v = resized(self.v, 0)
        if self.k_scale is not None and self.v_scale is not None:
            self.k_scale = resized(self.k_scale, 1)
            self.v_scale = resized(self.v_scale, 1)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [tokens, kv_heads, head_dim] at ``slots`` [tokens]."""
        k, v = self._encode(k, v)
        if self.k_scale is not None and self.v_scale is not None:
            k, k_scale = _quantize_e4m3(k)
            v, v_scale = _quantize_e4m3(v)
            self.k_scale.index_copy_(1, slots, k_scale)
            self.v_scale.index_copy_(1, slots, v_scale)
        _store(self.k, slots, k)
        _store(self.v, slots, v)

    def as_stored(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [tokens, kv_heads, head_dim] as ``read`` would return them after ``write``
        ([kv_heads, tokens, head_dim]): attention over a fresh prompt then sees exactly what
        a later chunk, a decode or a request sharing the prefix reads from the cache, so
        outputs do not depend on how a prompt was split or shared."""
        k, v = self._encode(k, v)
        dtype = self.k.dtype
        if dtype == torch.int8:
            return k.float(), v.float()
        if self.k_scale is not None:
            (qk, sk), (qv, sv) = _quantize_e4m3(k), _quantize_e4m3(v)
            c = self.compute_dtype
            return qk.to(c) * sk.to(c), qv.to(c) * sv.to(c)
        if dtype == self.compute_dtype:
            return k, v
        return k.to(dtype).to(self.compute_dtype), v.to(dtype).to(self.compute_dtype)

    def _encode(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [tokens, kv_heads, head_dim] → [kv_heads, tokens, head_dim], shifted, and
        as integers for INT8."""
        if self.k_shift is not None:
            k = k - self.k_shift
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        if self.k.dtype == torch.int8:
            p = self.int8
            if p is None:
                raise RuntimeError("an INT8 KV layer needs its calibration (Int8Params) first")
            return p.quantize_keys(k), p.quantize_values(v)
        return k, v

    @property
    def attention_dtype(self) -> torch.dtype:
        """The dtype ``read``, ``read_blocks``, ``as_stored`` and ``query`` return."""
        return torch.float32 if self.int8 is not None else self.compute_dtype

    def query(self, q: torch.Tensor) -> torch.Tensor:
        """The query [tokens, heads, head_dim] attention uses against what ``read``,
        ``read_blocks`` and ``as_stored`` return (itself, except for INT8)."""
        return q if self.int8 is None else self.int8.query(q)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """Attention's output [tokens, heads, head_dim] over what this cache returns, as the
        output over the keys and values it stands for (itself, except for INT8)."""
        return out if self.int8 is None else self.int8.output(out, self.compute_dtype)

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at ``slots`` (any shape S) as [kv_heads, *S, head_dim] in
        ``attention_dtype`` (for INT8: the stored integers in float32; see ``query``)."""
        k = _load(self.k, slots).to(self.attention_dtype)
        v = _load(self.v, slots).to(self.attention_dtype)
        if self.k_scale is not None and self.v_scale is not None:
            k = k * self.k_scale[:, slots].to(self.compute_dtype)
            v = v * self.v_scale[:, slots].to(self.compute_dtype)
        return k, v

    def read_blocks(self, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole blocks of ``tables`` [sequences, blocks] as [kv_heads, sequences,
        blocks * block_size, head_dim]. Each head's blocks are copied with one index_select
        over contiguous block rows, far faster than a gather per token."""
        k = self._gather_blocks(self.k, tables).to(self.attention_dtype)
        v = self._gather_blocks(self.v, tables).to(self.attention_dtype)
        if self.k_scale is not None and self.v_scale is not None:
            k = k * self._gather_blocks(self.k_scale, tables).to(k.dtype)
            v = v * self._gather_blocks(self.v_scale, tables).to(v.dtype)
        return k, v

    def _gather_blocks(self, cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        raw = cache.view(torch.uint8) if _is_fp8(cache) else cache
        heads, slots, width = raw.shape
        blocks = slots // self.block_size
        rows = raw.view(heads * blocks, self.block_size * width)  # one row per (head, block)
        index = torch.arange(heads, device=tables.device)[:, None] * blocks + tables.reshape(1, -1)
        gathered = rows.index_select(0, index.reshape(-1)).view(heads, tables.shape[0], -1, width)
        return gathered.view(cache.dtype) if _is_fp8(cache) else gathered


def _is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in (torch.float8_e5m2, torch.float8_e4m3fn)


def _store(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    # CPU kernels do not index float8 tensors: move their bytes as uint8.
    if _is_fp8(cache):
        cache.view(torch.uint8).index_copy_(1, slots, x.to(cache.dtype).view(torch.uint8))
    else:
        cache.index_copy_(1, slots, x.to(cache.dtype))


def _load(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    if _is_fp8(cache):
        return cache.view(torch.uint8)[:, slots].view(cache.dtype)
    return cache[:, slots]


def _quantize_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x32 = x.float()
    scale = (x32.abs().amax(dim=-1, keepdim=True) / _FP8_E4M3_MAX).clamp_min(1e-12)
    return (x32 / scale).to(torch.float8_e4m3fn), scale
