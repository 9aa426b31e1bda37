"""The encodings a spec can name, apart from the mixed window (which wraps one of them and
so reads this list: ``mixed.MIXABLE``); ``registry.REGISTRY`` is this list and the mixed window.

Holds: Entry, ENTRIES.
"""

from __future__ import annotations

import dataclasses

from .absolute import Learned, LearnedConfig, NoPE, NoPEConfig, Sinusoidal, SinusoidalConfig
from .adaremap import AdaRemap, AdaRemapConfig
from .adarope import AdaRoPE, AdaRoPEConfig, TunedYarn, TunedYarnConfig
from .alibi import ALiBi, ALiBiConfig
from .base import EncodingConfig, PositionEncoding
from .clipping import CopeConfig, HardClipConfig
from .harpe import Harpe, HarpeConfig
from .remap import (
    DCA,
    DCAConfig,
    ReRope,
    ReRopeConfig,
    SelfExtend,
    SelfExtendConfig,
    String,
    StringConfig,
)
from .rope import (
    DynamicNTKConfig,
    LinearConfig,
    Llama3Config,
    LongRopeConfig,
    NTKConfig,
    ProportionalConfig,
    RopeConfig,
    RotaryEncoding,
    YarnConfig,
)


@dataclasses.dataclass(frozen=True)
class Entry:
    """A registered encoding: its module class, config class, one-line summary and source."""

    module: type[PositionEncoding]
    config: type[EncodingConfig]
    summary: str
    source: str

    @property
    def name(self) -> str:
        return self.config.name


ENTRIES: tuple[Entry, ...] = (
    Entry(NoPE, NoPEConfig, "no positional encoding", "Haviv et al. 2022"),
    Entry(
        Sinusoidal,
        SinusoidalConfig,
        "fixed sinusoids added to embeddings",
        "Vaswani et al. 2017",
    ),
    Entry(Learned, LearnedConfig, "learned absolute position table", "GPT-2 (2019)"),
    Entry(ALiBi, ALiBiConfig, "linear distance penalty per head", "Press et al. 2022"),
    Entry(
        RotaryEncoding,
        RopeConfig,
        "rotary embedding; fraction<1 = partial RoPE",
        "Su et al. 2021",
    ),
    Entry(
        RotaryEncoding,
        LinearConfig,
        "position interpolation (PI)",
        "Chen et al. 2023",
    ),
    Entry(
        RotaryEncoding,
        ProportionalConfig,
        "p-RoPE: only the fastest pairs turn, exponents over the whole head (fraction cuts "
        "the head instead)",
        "Barbero et al. 2025",
    ),
    Entry(RotaryEncoding, NTKConfig, "NTK-aware base rescaling", "bloc97 2023"),
    Entry(
        RotaryEncoding,
        DynamicNTKConfig,
        "NTK base following the length",
        "emozilla 2023",
    ),
    Entry(
        RotaryEncoding,
        YarnConfig,
        "NTK-by-parts + attention temperature",
        "Peng et al. 2023",
    ),
    Entry(RotaryEncoding, Llama3Config, "Llama 3.1 band-wise scaling", "Meta 2024"),
    Entry(
        RotaryEncoding,
        LongRopeConfig,
        "searched per-pair rescale factors",
        "Ding et al. 2024",
    ),
    Entry(
        RotaryEncoding,
        CopeConfig,
        "slowest pairs softly clipped (Hann taper to theta = 0)",
        "Li et al. 2026 (CoPE)",
    ),
    Entry(
        RotaryEncoding,
        HardClipConfig,
        "slowest pairs stop rotating (CoPE's hard-clip control)",
        "Li et al. 2026 (CoPE)",
    ),
    Entry(
        Harpe,
        HarpeConfig,
        "fixed per-head bases: kv head k at the NTK base of stage s^((k+1)/K)",
        "Lian et al. 2024 (HARPE)",
    ),
    Entry(
        AdaRoPE,
        AdaRoPEConfig,
        "per-head learnable frequencies (AdaFreq) and temperature (AdaScale)",
        "Wang et al. 2026",
    ),
    Entry(
        TunedYarn,
        TunedYarnConfig,
        "YaRN with learnable global knobs",
        "ropekit (review's control)",
    ),
    Entry(
        ReRope,
        ReRopeConfig,
        "distances clipped at a window (leaky: slowed by 1/k beyond it)",
        "Su 2023",
    ),
    Entry(
        SelfExtend,
        SelfExtendConfig,
        "neighbour window with normal positions, grouped positions floor(p/G) beyond",
        "Jin et al. 2024",
    ),
    Entry(
        DCA,
        DCAConfig,
        "dual chunk attention: intra-, successive- and inter-chunk positions",
        "An et al. 2024",
    ),
    Entry(
        String,
        StringConfig,
        "far distances shifted onto well-trained small ones (shift S, window W); reach ~1.5 L0",
        "An et al. 2025",
    ),
    Entry(
        AdaRemap,
        AdaRemapConfig,
        "AdaRoPE's learned frequencies and temperatures over a remap's bands (remap=rerope...)",
        "ropekit (issue 58)",
    ),
)
