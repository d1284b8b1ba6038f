"""Inference: the engine (paged KV cache, continuous batching, sampling) over static programs.

=====================  ===========================================================================
``programs``           prefill/decode traced from a model (``to_static``), the tile-linear pass
``runner``             runs the two programs, owns the KV pool
``blocks``             KV block allocation, reference counts, prefix caching
``scheduler``          continuous batching: admission, token budget, aligned prompt chunks
``sampling``           SamplingParams and the per-request Sampler (penalties, logprobs, seeds)
``detokenize``         incremental text with stop strings
``engine``             Engine: from_model (live weights) / from_static (the model file)
``background``         EngineThread: steps an engine on a thread (the server's driver)
``chat``               chat templates as data (``Tokenizer`` is ``llmkit.tokenizer``'s)
``jinja_env``          the sandboxed Jinja environment (imported with the first template rendered)
=====================  ===========================================================================

Nothing here imports ``llmkit.models`` or any HTTP code: the server and RLHF both build on it.
"""

from llmkit.tokenizer import Tokenizer

from .background import EngineThread
from .chat import ChatTemplate, ChatTemplateError
from .engine import Engine, EngineConfig
from .request import Completion, FinishReason, RequestOutput
from .sampling import Sampler, SamplingParams, TokenChoice, sample

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "Completion",
    "Engine",
    "EngineConfig",
    "EngineThread",
    "FinishReason",
    "RequestOutput",
    "Sampler",
    "SamplingParams",
    "TokenChoice",
    "Tokenizer",
    "sample",
]
