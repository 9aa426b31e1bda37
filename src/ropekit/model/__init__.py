"""ropekit.model: a small reference decoder (byte-level by default) that takes any encoding.

``Decoder(DecoderConfig(encoding="adarope:l_ref=256"))`` builds it; ``forward`` returns a
``DecoderOutput`` (logits, loss, cache); ``generate`` decodes greedily with a ``KVCache``;
``save``/``Decoder.load`` use safetensors + config.json. ``count_parameters`` and
``flops_per_token`` report size and cost. The analysis hook (``attn.probe``) and the cache
semantics are described in ``decoder`` and ``cache``.
"""

from .cache import KVCache
from .checkpoint import save_decoder
from .config import DecoderConfig, default_ffn_hidden
from .decoder import IGNORE_INDEX, Decoder, DecoderOutput, Probe, lm_loss, load_decoder
from .flops import count_parameters, flops_per_token, matmul_parameters, model_flops_utilization

__all__ = [
    "IGNORE_INDEX",
    "Decoder",
    "DecoderConfig",
    "DecoderOutput",
    "KVCache",
    "Probe",
    "count_parameters",
    "default_ffn_hidden",
    "flops_per_token",
    "lm_loss",
    "load_decoder",
    "matmul_parameters",
    "model_flops_utilization",
    "save_decoder",
]
