"""The engine's configuration: one pydantic model, torch-free, shared with the operator."""

from brook_engine.config.base import ConfigError, Section
from brook_engine.config.engine import (
    DeviceKind,
    EngineConfig,
    ModelFacts,
    dump_engine_config,
    load_engine_config,
    parse_engine_config,
)
from brook_engine.config.errors import describe_errors, error_message, error_path, field_path
from brook_engine.config.kv_cache import (
    CPU_KV_CACHE_CAP,
    DEFAULT_MEMORY_FRACTION,
    DynamicPrecisionConfig,
    KVCacheConfig,
    KVDType,
    LayerPolicy,
    PrefixSharingConfig,
    seed_layer_policies,
)
from brook_engine.config.model import (
    DOWNLOAD_PROGRESS_PATH,
    MODEL_FILES,
    MODEL_URI_SCHEMES,
    ModelConfig,
    split_model_uri,
)
from brook_engine.config.offload import OffloadConfig
from brook_engine.config.parallel import ParallelConfig
from brook_engine.config.runtime import (
    MoEConfig,
    QuantizationConfig,
    SchedulerConfig,
    ShapePattern,
    ShapesConfig,
)
from brook_engine.config.sections import EngineSections
from brook_engine.config.server import ApiKeyConfig, ServerConfig, ServerOptions

__all__ = [
    "CPU_KV_CACHE_CAP",
    "DEFAULT_MEMORY_FRACTION",
    "DOWNLOAD_PROGRESS_PATH",
    "MODEL_FILES",
    "MODEL_URI_SCHEMES",
    "ApiKeyConfig",
    "ConfigError",
    "DeviceKind",
    "DynamicPrecisionConfig",
    "EngineConfig",
    "EngineSections",
    "KVCacheConfig",
    "KVDType",
    "LayerPolicy",
    "MoEConfig",
    "ModelConfig",
    "ModelFacts",
    "OffloadConfig",
    "ParallelConfig",
    "PrefixSharingConfig",
    "QuantizationConfig",
    "SchedulerConfig",
    "Section",
    "ServerConfig",
    "ServerOptions",
    "ShapePattern",
    "ShapesConfig",
    "describe_errors",
    "dump_engine_config",
    "error_message",
    "error_path",
    "field_path",
    "load_engine_config",
    "parse_engine_config",
    "seed_layer_policies",
    "split_model_uri",
]
