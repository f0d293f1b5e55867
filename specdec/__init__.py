"""specdec: exact speculative decoding on a paged-KV, continuously batched runtime."""

from specdec.beam_search import BeamSearchOutput, BeamSearchParams
from specdec.config import SamplingParams
from specdec.drafters.registry import SpecConfig
from specdec.engine_config import EngineConfig
from specdec.llm import LLM, ChatOptions
from specdec.lora import LoRARequest
from specdec.outputs import RequestOutput, TokenLogprobs
from specdec.pooling import EmbeddingRequestOutput, PoolingParams
from specdec.scoring import ScoringRequestOutput
from specdec.structured.params import GuidedDecodingParams, StructuredOutputsParams
from specdec.wrap import WrappedModel, wrap

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "ChatOptions",
    "EmbeddingRequestOutput",
    "EngineConfig",
    "LoRARequest",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "ScoringRequestOutput",
    "SpecConfig",
    "StructuredOutputsParams",
    "GuidedDecodingParams",
    "TokenLogprobs",
    "WrappedModel",
    "wrap",
]
__version__ = "0.1.0"
