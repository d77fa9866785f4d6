"""minikv: a GPT-2 small enough to read in an afternoon, and the KV cache that makes it fast."""
from .cache import KVCache, kv_cache_bytes
from .checkpoint import load_course_model
from .config import PRESETS, GPTConfig
from .device import default_device, describe_device, resolve_device
from .generate import GenerationOutput, generate
from .model import GPT
from .serving import Request, RequestOutput, serve
from .speculative import speculative_generate
from .tokenizer import EOT, load_tokenizer
from .trace import KVCounter, Stats, TraceEvent
from .verify import Verdict, verify_and_commit

__all__ = [
    "GPT", "GPTConfig", "PRESETS", "KVCache", "kv_cache_bytes", "generate", "GenerationOutput",
    "Stats", "TraceEvent", "KVCounter", "default_device", "describe_device", "resolve_device",
    "load_tokenizer", "EOT", "speculative_generate", "serve", "Request", "RequestOutput", "Verdict",
    "verify_and_commit", "load_course_model",
]
