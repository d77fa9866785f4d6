"""The engine: a GPT-2 and the ways it decodes with a KV cache. Read config, model,
rope, cache, sampling, generate, records, tree, verify, speculative, lookup, eagle, attention,
flash, batch, paged, radix, scheduler, serving, session, parallel, disagg, static, then the caches
that hold less (quantized, window, evict), then validate; it imports no tooling."""
from .batch import generate_batch
from .cache import Cache, KVCache, kv_cache_bytes
from .config import PRESETS, GPTConfig
from .eagle import FeatureHead, feature_generate
from .evict import H2OCache, SnapKVCache
from .generate import generate
from .lookup import lookup_generate
from .model import GPT, causal_attention
from .parallel import tensor_parallel
from .quantized import QuantizedKVCache
from .radix import Radix, RadixTree
from .records import GenerationOutput, KVCounter, RequestOutput, Stats, TraceEvent
from .sampling import Request, SamplingParams
from .scheduler import FirstComeFirstServed, Scheduler
from .serving import Engine, serve
from .speculative import Proposal, Proposer, Speculation, speculate, speculative_generate
from .verify import Verdict, verify_and_commit
from .window import SinkWindowCache

__all__ = ["Cache", "KVCache", "kv_cache_bytes", "PRESETS", "GPTConfig", "GenerationOutput",
           "generate", "GPT", "causal_attention", "KVCounter", "Stats", "TraceEvent",
           "SamplingParams", "Request", "RequestOutput", "serve", "speculative_generate",
           "speculate", "Proposal", "lookup_generate", "generate_batch", "QuantizedKVCache",
           "SinkWindowCache", "Verdict", "verify_and_commit", "Scheduler",
           "FirstComeFirstServed", "Speculation", "FeatureHead", "feature_generate", "Engine",
           "Proposer", "Radix", "RadixTree", "H2OCache", "SnapKVCache", "tensor_parallel"]

