"""EngineConfig: defaults, the file form, both spellings, and errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from brook_engine.config import (
    ConfigError,
    EngineConfig,
    ModelFacts,
    dump_engine_config,
    load_engine_config,
    parse_engine_config,
    split_model_uri,
)

FULL = {
    "model": {
        "uri": "hf://Qwen/Qwen2.5-7B-Instruct",
        "revision": "main",
        "servedName": "qwen",
        "dtype": "bfloat16",
        "maxModelLen": 4096,
    },
    "device": "npu",
    "parallel": {"tensor": 2, "pipeline": 2, "microBatches": 4},
    "offload": {
        "policy": "adaptive",
        "deviceMemoryLimitGb": 24,
        "cpuMemoryPoolGb": 64,
        "priorityLayers": ["ffn", "attention"],
        "prefetchLayers": 2,
    },
    "kvCache": {
        "blockSize": 32,
        "maxSeqLen": 4096,
        "numBlocks": 2048,
        "layerPolicies": [
            {"start": 0.0, "end": 0.5, "dtype": "fp8_e4m3"},
            {"start": 0.5, "end": 1.0, "dtype": "bf16"},
        ],
        "dynamicPrecision": {"enabled": True, "sensitivityThreshold": 0.1, "fallbackDtype": "bf16"},
        "prefixSharing": {"minPrefixLen": 64, "hash": "xxh3", "eviction": "lfu"},
    },
    "quantization": {"weights": "w8a16"},
    "shapes": {
        "mode": "compile",
        "patterns": [{"inputLen": 512, "outputLen": 128}],
        "kernelCacheSize": 8,
        "onlineLearning": True,
    },
    "moe": {"topK": 2, "loadThreshold": 1.5, "reroute": True},
    "scheduler": {"maxNumSeqs": 64, "maxNumBatchedTokens": 1024, "chunkedPrefill": True},
    "server": {"host": "0.0.0.0", "port": 9000, "apiKey": {"env": "BROOK_API_KEY"}},
}


def test_defaults_are_the_documented_ones() -> None:
    config = EngineConfig(model={"uri": "/models/x"})  # type: ignore[arg-type]
    assert config.parallel.world_size == 1
    assert config.kv_cache.block_size == 16
    assert config.kv_cache.effective_memory_fraction == 0.9
    assert config.kv_cache.effective_min_prefix_len == 16
    # The seed's policy: first 30% FP8 E5M2, last 30% FP16; the middle INT8 (our choice).
    assert config.kv_cache.layer_dtypes(10) == ["fp8_e5m2"] * 3 + ["int8"] * 4 + ["fp16"] * 3
    assert config.server.host == "127.0.0.1"
    assert config.server.api_key is None


@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_round_trip_through_the_mounted_file(tmp_path: Path, fmt: str) -> None:
    config = parse_engine_config(FULL)
    path = tmp_path / f"engine.{fmt}"
    path.write_text(dump_engine_config(config, fmt=fmt))  # type: ignore[arg-type]
    assert load_engine_config(path) == config
    # The file is camelCase, as the CRD is.
    assert "maxModelLen" in path.read_text()
    assert "max_model_len" not in path.read_text()


def test_snake_case_keywords_mean_the_same() -> None:
    camel = parse_engine_config(FULL)
    snake = EngineConfig(
        model={
            "uri": "hf://Qwen/Qwen2.5-7B-Instruct",
            "revision": "main",  # type: ignore[arg-type]
            "served_name": "qwen",
            "dtype": "bfloat16",
            "max_model_len": 4096,
        },
        device="npu",
        parallel={"tensor": 2, "pipeline": 2, "micro_batches": 4},  # type: ignore[arg-type]
        offload={
            "policy": "adaptive",
            "device_memory_limit_gb": 24,  # type: ignore[arg-type]
            "cpu_memory_pool_gb": 64,
            "priority_layers": ["ffn", "attention"],
            "prefetch_layers": 2,
        },
        kv_cache=camel.kv_cache,
        quantization={"weights": "w8a16"},  # type: ignore[arg-type]
        shapes=camel.shapes,
        moe={"top_k": 2, "load_threshold": 1.5, "reroute": True},  # type: ignore[arg-type]
        scheduler={"max_num_seqs": 64, "max_num_batched_tokens": 1024},  # type: ignore[arg-type]
        server={
            "host": "0.0.0.0",
            "port": 9000,  # type: ignore[arg-type]
            "api_key": {"env": "BROOK_API_KEY"},
        },
    )
    assert snake == camel


def test_config_is_frozen() -> None:
    config = parse_engine_config(FULL)
    with pytest.raises(ValueError, match="frozen"):
        config.parallel.tensor = 4  # type: ignore[misc]


def _with(path: str, value: object) -> dict[str, object]:
    """FULL with one key (dotted path) replaced; value None deletes it."""
    import copy

    data = copy.deepcopy(FULL)
    *parents, leaf = path.split(".")
    node: dict[str, object] = data
    for part in parents:
        node = node.setdefault(part, {})  # type: ignore[assignment]
    if value is None:
        node.pop(leaf, None)
    else:
        node[leaf] = value
    return data


BAD = [
    ("model.uri", "http://example.com/m", "model.uri", "scheme 'http' is not supported"),
    ("model.uri", "hf://", "model.uri", "names no model"),
    ("model.dtype", "int4", "model.dtype", "'auto', 'bfloat16'"),
    ("parallel.tensor", 0, "parallel.tensor", "greater than or equal to 1"),
    ("parallel.tensr", 2, "parallel.tensr", "unknown field; known fields: microBatches"),
    ("offload.deviceMemoryLimitGb", None, "offload", "deviceMemoryLimitGb is required"),
    ("offload.priorityLayers", ["ffn", "ffn"], "offload", "lists a kind twice"),
    ("kvCache.blockSize", 24, "kvCache.blockSize", "8, 16, 32"),
    ("kvCache.memoryFraction", 0.5, "kvCache", "memoryFraction or numBlocks, not both"),
    (
        "kvCache.layerPolicies",
        [{"start": 0, "end": 0.6, "dtype": "fp16"}, {"start": 0.5, "end": 1, "dtype": "fp16"}],
        "kvCache",
        "overlap",
    ),
    (
        "kvCache.layerPolicies",
        [{"start": 0.5, "end": 0.5, "dtype": "fp16"}],
        "kvCache.layerPolicies[0]",
        "must be below end",
    ),
    ("kvCache.prefixSharing.minPrefixLen", 40, "kvCache", "so use 64"),
    ("kvCache.maxSeqLen", 8192, "", "kvCache.maxSeqLen (8192) exceeds"),
    ("scheduler.maxNumSeqs", 2048, "scheduler", "below maxNumSeqs"),
    ("scheduler.chunkedPrefill", False, "", "chunkedPrefill off"),
    ("shapes.patterns", [{"inputLen": 4000, "outputLen": 200}], "", "patterns[0]"),
    ("server.apiKey", {"env": "A", "file": "/k"}, "server.apiKey", "exactly one of env and file"),
    ("server.port", 70000, "server.port", "less than or equal to 65535"),
]


@pytest.mark.parametrize(("key", "value", "path", "text"), BAD, ids=[b[0] for b in BAD])
def test_bad_config_names_the_field(key: str, value: object, path: str, text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_engine_config(_with(key, value), source="test config")
    message = str(info.value)
    if path:
        assert f"{path}: " in message
    assert text in message


def test_missing_model_is_named() -> None:
    with pytest.raises(ConfigError, match=r"model: Field required"):
        parse_engine_config({})


def test_load_reports_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_engine_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_engine_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_engine_config(scalar)


FACTS = ModelFacts(
    num_layers=4, num_attention_heads=8, num_kv_heads=2, max_position_embeddings=2048
)


def test_checks_against_the_model() -> None:
    base = {"model": {"uri": "/m"}}
    EngineConfig.model_validate(base).check_against_model(FACTS)
    cases = [
        ({"parallel": {"pipeline": 8}}, "parallel.pipeline (8) exceeds the model's 4 layers"),
        ({"parallel": {"tensor": 3}}, "must divide the model's 8 attention heads"),
        ({"model": {"uri": "/m", "maxModelLen": 4096}}, "exceeds the model's maxPosition"),
        ({"kvCache": {"maxSeqLen": 4096}}, "kvCache.maxSeqLen (4096) exceeds the model length"),
    ]
    for overrides, text in cases:
        config = EngineConfig.model_validate({**base, **overrides})
        with pytest.raises(ConfigError, match=text.replace("(", r"\(").replace(")", r"\)")):
            config.check_against_model(FACTS)
    # TP 4 over 2 KV heads replicates them: allowed.
    EngineConfig.model_validate({**base, "parallel": {"tensor": 4}}).check_against_model(FACTS)


def test_layer_ranges_cover_by_fraction() -> None:
    config = EngineConfig.model_validate(
        {
            "model": {"uri": "/m"},
            "kvCache": {
                "layerPolicies": [
                    {"start": 0.0, "end": 0.25, "dtype": "fp8_e5m2"},
                    {"start": 0.75, "end": 1.0, "dtype": "fp16"},
                ]
            },
        }
    )
    # Uncovered layers keep the model dtype.
    assert config.kv_cache.layer_dtypes(4) == ["fp8_e5m2", "auto", "auto", "fp16"]
    assert config.kv_cache.layer_dtypes(1) == ["fp8_e5m2"]


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("hf://org/name", ("hf", "org/name")),
        ("PVC://claim/path", ("pvc", "claim/path")),
        ("/models/x", ("file", "/models/x")),
        ("relative/dir", ("file", "relative/dir")),
    ],
)
def test_split_model_uri(uri: str, expected: tuple[str, str]) -> None:
    assert split_model_uri(uri) == expected


def test_options_override_a_whole_configuration_file(tmp_path: Path) -> None:
    """``brook-engine serve --config FILE --max-num-seqs 5``: a file written in full (camelCase,
    as ``brook-engine config`` and the bench write it) merges with options by field name."""
    from brook_engine.llm import engine_config_from_options

    path = tmp_path / "engine.yaml"
    path.write_text(dump_engine_config(parse_engine_config(FULL)))
    base = load_engine_config(path)
    options = {"max_num_seqs": 5, "kv_cache": {"block_size": 32}, "server": {"port": 9000}}
    config = engine_config_from_options(None, options, base)
    assert config.scheduler.max_num_seqs == 5 and config.kv_cache.block_size == 32
    assert config.server.port == 9000
    assert config.model == base.model  # the rest as the file has it
    assert config.scheduler.max_num_batched_tokens == base.scheduler.max_num_batched_tokens
    assert config.kv_cache.layer_policies == base.kv_cache.layer_policies
