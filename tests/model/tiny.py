"""Tiny decoders for the model tests: one spec per registered encoding, GQA by default.

Holds:
    SPECS          registry name -> a spec that builds it at the tiny shape (context 8).
    DYNAMIC        the names whose schedule follows the current length.
    REMAPS         the names that remap the query-key distance (banded attention).
    RELATIVE       specs whose logits depend only on relative positions.
    FP32           assert_close tolerances for float32 paths that sum in a different order.
    tiny_model     a seeded tiny Decoder, learnable encoding parameters moved off their init.
"""

from __future__ import annotations

import torch

from ropekit.model import Decoder, DecoderConfig

CONTEXT = 8  # training length of the tiny models: tests run past it (dynamic NTK, LongRoPE)

SPECS = {
    "nope": "nope",
    "sinusoidal": "sinusoidal",
    "learned": "learned:max_length=64",
    "alibi": "alibi",
    "rope": "rope",
    "linear": "linear:factor=2",
    "ntk": "ntk:factor=2",
    "proportional": "proportional:proportion=0.5",
    "dynamic-ntk": "dynamic-ntk:factor=2",
    "yarn": "yarn:factor=4",
    "llama3": "llama3:factor=4",
    "longrope": "longrope:factor=4,long_factor=[2],short_factor=[1.5]",
    "cope": "cope",
    "hardclip": "hardclip:clip=2",
    "harpe": "harpe:factor=2",
    "adarope": "adarope:l_ref=4",
    "tuned-yarn": "tuned-yarn:factor=4",
    "mixed": "mixed:method=adarope,init=yarn,factor=4",  # rope within 8 tokens, AdaRoPE beyond
    "rerope": "rerope:window=5,leaky=2",
    "self-extend": "self-extend:group=2,window=4",
    "dca": "dca:chunk_size=6,local_size=2,scale=none",  # the positions alone: a static remap
    "string": "string:shift=5,window=2,scale=none",
    # a fixed temperature over a remap: bands whose queries carry t of their true position
    "temperature": "temperature:rule=logn,method=rerope,window=5,leaky=2",
    # AdaRoPE's learned frequencies and temperatures in Leaky ReRoPE's bands
    "adarope-remap": "adarope-remap:remap=rerope,window=5,leaky=2,l_ref=4",
}

# Length-following schedules: keys are cached unrotated and re-rotated every step.
DYNAMIC = {"dynamic-ntk", "longrope", "mixed"}

# Distance remaps: attention in bands over cached unrotated keys.
REMAPS = {"rerope", "self-extend", "dca", "string", "temperature", "adarope-remap"}

# Logits invariant to shifting every position: no absolute table, no length-following
# schedule, no AdaScale (its temperature follows the absolute length by design).
RELATIVE = [
    "nope",
    "alibi",
    "rope",
    "rope:pairing=interleaved,fraction=0.5",
    "yarn:factor=4",
    "adarope:scale=false",
    "tuned-yarn:factor=4",
]

FP32 = {"atol": 2e-5, "rtol": 2e-5}


def tiny_model(spec: str = "rope", seed: int = 0, perturb: bool = True, **overrides) -> Decoder:
    """d_model 32, 2 layers, 4 query heads sharing 2 key/value heads, byte vocabulary.

    ``perturb`` moves every learnable encoding parameter (AdaRoPE's frequencies and
    temperatures, tuned-yarn's knobs, the learned table) off its initial value, so tests see
    trained-looking encodings rather than the base schedule in disguise.
    """
    fields = {
        "d_model": 32,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "context_length": CONTEXT,
        "init_std": 0.25,  # sharp attention, so position errors show in the logits
        "encoding": spec,
        **overrides,
    }
    torch.manual_seed(seed)
    model = Decoder(DecoderConfig(**fields))
    if perturb:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for p in model.encoding.parameters():
                p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def random_ids(B: int, T: int, seed: int = 0, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))
