"""Peer runners for ``brook-engine bench --compare``: the same workload on Hugging Face
transformers (``hf_runner``, in the project's venv) and on vLLM's CPU build (``vllm_runner``, a
standalone script for vLLM's own venv, set up by ``setup_vllm.ensure_vllm_venv``).

Each runner reads a workload JSON (``--workload FILE``)::

    {"model": "/path/to/hf/folder", "dtype": "float32" | "bfloat16", "threads": 2,
     "prompts": [[token ids], ...], "max_tokens": [int per prompt], "ignore_eos": true,
     "mode": "batch" | "single"}

and prints its result as the last line of stdout (progress goes to stderr)::

    {"engine": "hf" | "vllm", "version": ..., "requests": N, "prompt_tokens": ...,
     "output_tokens": ..., "useful_output_tokens": ..., "computed_output_tokens": ...,
     "elapsed_s": ..., "load_s": ..., "output_tok_s": ..., "total_tok_s": ...,
     "ttft_s": [per request] | null, "peak_rss_mb": ...}

``output_tokens`` counts the tokens each request received (at most its own ``max_tokens``);
``useful_output_tokens`` is the sum of ``max_tokens``; ``computed_output_tokens`` counts every
token the engine decoded, padding rows of a static batch included. ``elapsed_s`` is wall time
of generation only; model load and a short warm-up are in ``load_s``.

Neither runner tokenizes or detokenizes: prompts arrive as token ids and outputs stay ids.
Both read the workload and build the result with ``peer_protocol`` (standard library only, so
``vllm_runner`` can import it from vLLM's venv as the module beside it).
"""
