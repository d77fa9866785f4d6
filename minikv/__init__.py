"""minikv: a GPT-2 small enough to read in an afternoon, and the KV cache that makes it fast.

    minikv/engine/   the engine: model, cache, decoders (read it: see its __init__ for the order)
    minikv/viz/      pictures and steppers drawn from the engine's traces
    minikv/course/   the course models and how they are made, the tokenizer, exercise checkers
    minikv/bench/    `python -m minikv bench`: speed, as ratios against same-run baselines
    minikv/server.py `python -m minikv serve-http`: the server behind an OpenAI-compatible API
"""
from .course.checkpoint import load_course_model, load_feature_head
from .course.device import default_device, describe_device, resolve_device
from .course.pretrained import from_pretrained
from .course.tokenizer import EOT, load_tokenizer
from .engine import (
    GPT,
    PRESETS,
    GenerationOutput,
    GPTConfig,
    H2OCache,
    KVCache,
    KVCounter,
    QuantizedKVCache,
    Radix,
    Request,
    RequestOutput,
    SamplingParams,
    SinkWindowCache,
    SnapKVCache,
    Speculation,
    Stats,
    TraceEvent,
    Verdict,
    feature_generate,
    generate,
    generate_batch,
    kv_cache_bytes,
    lookup_generate,
    serve,
    speculative_generate,
    tensor_parallel,
    verify_and_commit,
)

__all__ = [
    "GPT", "GPTConfig", "PRESETS", "KVCache", "kv_cache_bytes", "generate", "GenerationOutput",
    "SamplingParams", "Stats", "TraceEvent", "KVCounter", "default_device", "describe_device",
    "resolve_device", "load_tokenizer", "EOT", "speculative_generate", "serve", "Request",
    "RequestOutput", "Verdict", "verify_and_commit", "load_course_model", "lookup_generate",
    "generate_batch", "QuantizedKVCache", "SinkWindowCache", "Speculation", "feature_generate",
    "load_feature_head", "Radix", "H2OCache", "SnapKVCache", "tensor_parallel",
    "from_pretrained",
]
