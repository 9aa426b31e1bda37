"""Every family of ropekit.hf.archs.ARCHS, on tiny random models transformers builds from its
own config classes (tests/tiny.py ``family_model``; no download):

(a) patched with the model's own RoPE, logits equal the unpatched model's, in eager and sdpa,
    with left padding, and through the KV cache one token at a time and in chunks;
(b) patched with each schedule transformers also implements, logits equal transformers' own
    model configured with that ``rope_parameters``;
(c) a distance remap (Leaky ReRoPE, DCA) equals an independent pairwise definition written
    here (the remapped distance of every query-key pair, tests/encodings/test_remap.py), full
    and cached; families whose attention has extras the bands do not compute refuse it;
(d) exported (``ropekit.serve.export``), the folder loads in plain transformers with the
    rope_parameters of (b) and the patched model's logits.

A wrong row of the registry (pairing, which layers rotate, the recipe) fails (a) or (b).
Tolerances: float32 round-off of logits of magnitude ~1 (the patched and unpatched paths
rotate with differently rounded tables).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from ropekit.hf import attention as hf_attention
from ropekit.hf import patch, spec_from_config
from ropekit.hf.archs import ARCHS, arch_for, default_types, rope_parameters, rotating_types
from ropekit.hf.patching import build_for_model

from ..encodings.test_remap import dca_distance, rerope_distance, rotate_pairs
from ..tiny import L0, VOCAB, family_config, family_model

FAMILIES = sorted(ARCHS)
# The families whose schedule and remap cases run in `make test`, one of each kind of row
# (plain, per-type RoPE and a recipe, per-layer dims and p-RoPE, partial, interleaved, NoPE
# layers, LongRoPE only); every family's cases run in `make test-slow`. (a) runs for all.
EVERY_KIND = {
    "llama", "gemma3_text", "gemma4_text", "olmo3", "phi3", "stablelm", "glm4", "cohere2",
    "llama4_text", "qwen2",
}  # fmt: skip


def _cases(pairs):
    """Parameters for (family, ...) cases: those of EVERY_KIND in the default suite, the
    others marked slow."""
    return [
        pytest.param(*pair, marks=() if pair[0] in EVERY_KIND else pytest.mark.slow)
        for pair in pairs
    ]


ATOL = 1e-4  # float32 round-off (Llama 4 normalises q, k a second time: 5e-5); a wrong row: O(1)
CHUNKS = (12, 1, 1, 1, 1, 5, 3, 1, 1, 4, 2)  # 32 tokens: prefill, single steps, chunks


def _ids(batch: int, length: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(2, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _implementations(family: str) -> list[str]:
    default = family_model(family).config._attn_implementation
    return ["eager", "sdpa"] if default == "sdpa" else [default]


def _cached_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits of every position read chunk by chunk (CHUNKS) through one DynamicCache."""
    cache, out, start = DynamicCache(config=model.config), [], 0
    with torch.no_grad():
        for n in CHUNKS:
            positions = torch.arange(start, start + n)[None]
            step = model(ids[:, start : start + n], position_ids=positions, cache=cache)
            out.append(step.logits)
            start += n
    return torch.cat(out, dim=1)


def _padded(model: torch.nn.Module) -> torch.Tensor:
    """A batch of two rows, the second left-padded by 6: logits (2, 24, V)."""
    ids = _ids(2, 24)
    mask = (torch.arange(24) >= torch.tensor([[0], [6]])).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    return out * mask[..., None]  # pads' rows are arbitrary


# ----------------------------------------------------------------------------- (a)
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_with_its_own_rope_the_model_is_unchanged(family: str) -> None:
    ids = _ids(1, sum(CHUNKS))
    for implementation in _implementations(family):
        model = family_model(family, attn_implementation=implementation)
        with torch.no_grad():
            full = model(ids, use_cache=False).logits
        padded, cached = _padded(model), _cached_logits(model, ids)
        patch(model, spec_from_config(model.config))
        with torch.no_grad():
            torch.testing.assert_close(model(ids, use_cache=False).logits, full, atol=ATOL, rtol=0)
        torch.testing.assert_close(_padded(model), padded, atol=ATOL, rtol=0)
        torch.testing.assert_close(_cached_logits(model, ids), cached, atol=ATOL, rtol=0)


def test_a_wrong_row_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry is what makes (a) pass: Cohere pairs its channels interleaved."""
    import dataclasses

    wrong = dataclasses.replace(ARCHS["cohere"], pairing="half")
    monkeypatch.setitem(ARCHS, "cohere", wrong)
    with pytest.raises(AssertionError):
        test_patched_with_its_own_rope_the_model_is_unchanged("cohere")


# ----------------------------------------------------------------------------- (b)
def _schedules(family: str) -> dict[str, dict]:
    """The rope_parameters (the whole dict the config takes) of each schedule transformers
    implements and this family's config accepts, for the layer types a spec covers by default
    (LongRoPE's factors sized to their rotary pairs). Over p-RoPE (Gemma 4's global layers),
    transformers' one scaled form is "proportional" with a factor; ropekit's schedules there
    keep the model's proportion, so only that one is compared."""
    base = family_config(family)
    kinds = default_types(base)
    own = rope_parameters(base, kinds[0])
    pairs = build_for_model(base, "rope").n_pairs
    candidates = {
        "linear": {"rope_type": "linear", "factor": 2.0},
        "dynamic": {"rope_type": "dynamic", "factor": 2.0},
        "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        "llama3": {
            "rope_type": "llama3",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
        "longrope": {
            "rope_type": "longrope",
            "short_factor": [1.0 + i / pairs for i in range(pairs)],
            "long_factor": [1.0 + 3 * i / pairs for i in range(pairs)],
            "original_max_position_embeddings": 16,
            "factor": 2.0,
        },
    }
    if own.get("rope_type") == "proportional":
        candidates = {"proportional": {"rope_type": "proportional", "factor": 2.0}}
    keep = {k: own[k] for k in ("rope_theta", "partial_rotary_factor") if k in own}
    nested = isinstance(next(iter(base.rope_parameters.values())), dict)
    out = {}
    for name, params in candidates.items():
        # every type the spec covers by default (OLMo 3: both, one base; Gemma 3/4: the global)
        rope = {**keep, **params}
        rope = {**base.rope_parameters, **dict.fromkeys(kinds, rope)} if nested else rope
        try:
            family_config(family, rope_parameters=rope)
        except Exception:  # the family's config class refuses it (Phi-3: longrope only)
            continue
        out[name] = rope
    return out


CASES = _cases((family, name) for family in FAMILIES for name in _schedules(family))


@pytest.mark.parametrize(("family", "schedule"), CASES)
def test_each_schedule_equals_transformers_own_model(family: str, schedule: str) -> None:
    kind = default_types(family_config(family))[0]
    rope = _schedules(family)[schedule]
    theirs = family_model(family, rope_parameters=rope, max_position_embeddings=2 * L0)
    ours = family_model(family, max_position_embeddings=2 * L0)
    ours.load_state_dict(theirs.state_dict())
    ids = _ids(2, 48)  # past L0 (dynamic, longrope's switch) and every original length
    with torch.no_grad():
        expected = theirs(ids, use_cache=False).logits
        patch(ours, spec_from_config(theirs.config, kind))
        torch.testing.assert_close(ours(ids, use_cache=False).logits, expected, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- (d) export
def _export_cases():
    """(family, schedule): every family's first schedule in the default suite (the others
    slow, with every family outside EVERY_KIND)."""
    for family in FAMILIES:
        for i, name in enumerate(_schedules(family)):
            # Gemma 4's tiny model keeps its config's per-layer embedding table (262,144 ids):
            # writing and reading it back takes ~14 s, so its export runs in make test-slow.
            fast = family in EVERY_KIND and i == 0 and family != "gemma4_text"
            yield pytest.param(family, name, marks=() if fast else pytest.mark.slow)


@pytest.mark.parametrize(("family", "schedule"), list(_export_cases()))
def test_an_export_loads_in_plain_transformers_with_the_same_logits(
    family: str, schedule: str, tmp_path
) -> None:
    """The exported folder's rope_parameters (nested by layer type where the config nests
    them, the types a spec leaves keeping their own) are what transformers' own model of that
    schedule holds, and plain transformers serves the patched model's logits."""
    from transformers import AutoModelForCausalLM

    from ropekit.serve import export

    kind = default_types(family_config(family))[0]
    theirs = family_model(family, rope_parameters=_schedules(family)[schedule])
    ours = family_model(family)
    ours.load_state_dict(theirs.state_dict())
    patch(ours, spec_from_config(theirs.config, kind))
    served = AutoModelForCausalLM.from_pretrained(export(ours, None, tmp_path / "out")).eval()
    for layer_type in rotating_types(theirs.config):  # the same schedule, defaults spelled out
        assert spec_from_config(served.config, layer_type) == spec_from_config(
            theirs.config, layer_type
        )
    ids = _ids(2, 48)
    with torch.no_grad():
        expected = ours(ids, use_cache=False).logits
        torch.testing.assert_close(served(ids, use_cache=False).logits, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("family", "spec", "message"),
    [
        # one flat rope_parameters for sliding and full layers: transformers rotates all alike
        ("qwen2", "yarn:factor=4,layers=global", "one rope_parameters for all its layers"),
        # transformers computes p-RoPE only as rope type proportional
        ("gemma4_text", "yarn:factor=4", "p-RoPE only as rope_type proportional"),
        # Phi3Config takes default and longrope only
        ("phi3", "linear:factor=2", "Phi3Config refuses the exported rope_parameters"),
    ],
)
def test_what_a_familys_config_cannot_hold_is_refused_before_writing(
    family: str, spec: str, message: str, tmp_path
) -> None:
    from ropekit.hf import ExportRefused
    from ropekit.serve import export

    model = family_model(family)
    patch(model, spec)
    with pytest.raises(ExportRefused, match=message) as info:
        export(model, None, tmp_path / "out")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


def test_a_gguf_of_a_family_the_writer_cannot_write_names_llama_cpps_converter(tmp_path):
    from ropekit.hf import ExportRefused
    from ropekit.serve import export

    model = family_model("gemma3_text")
    patch(model, "linear:factor=2")
    with pytest.raises(ExportRefused, match=r"convert_hf_to_gguf\.py") as info:
        export(model, None, tmp_path / "out", format="gguf")
    assert "\n" not in str(info.value) and "gemma3_text" in str(info.value)
    assert "GGUF writer handles llama, mistral (llama.cpp's llama graph" in str(info.value)
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- (c)
REMAPS = {
    "rerope:window=6,leaky=4": rerope_distance(6, 4.0),
    "dca:chunk_size=12,local_size=4,scale=none": dca_distance(12, 4),
}


def _pairwise(remap):
    """A stand-in for ropekit.hf.attention._banded: softmax_j(scale <R(d'(i, j)) q_i, k_j>) v_j
    with the model's mask, pair by pair (RoPE logits depend on the distance alone)."""

    def attend(module, patch, q, k, v, positions, key_positions, mask, scaling, dropout):
        encoding = patch.encoding
        H, T, S = q.shape[1], q.shape[-2], k.shape[-2]
        theta, factor = encoding.inv_freq(patch.index)
        qp, kp = positions.expand(q.shape[0], -1), key_positions.expand(q.shape[0], -1)
        d = torch.tensor(
            [
                [[remap(int(i), int(j)) for j in krow] for i in qrow]
                for qrow, krow in zip(qp.tolist(), kp.tolist(), strict=True)
            ],
            dtype=torch.float64,
        )  # (B, T, S)
        phi = d[..., None] * theta[0]  # (B, T, S, F)
        cos, sin = phi.cos()[:, None].float(), phi.sin()[:, None].float()
        rotated = rotate_pairs(q[:, :, :, None, :], cos, sin, encoding.pairing)
        keys = k.repeat_interleave(H // k.shape[1], dim=1)[:, :, None]  # (B, H, 1, S, D)
        logits = (rotated * keys).sum(-1) * float(factor) ** 2 * scaling  # (B, H, T, S)
        visible = (kp[:, None, :] <= qp[:, :, None])[:, None]  # causal by position
        if mask is not None:
            m = mask[..., -T:, -S:]
            logits = logits + m if m.is_floating_point() else logits.masked_fill(~m, -torch.inf)
        logits = logits.masked_fill(~visible, -torch.inf)
        values = v.repeat_interleave(H // v.shape[1], dim=1)
        return (logits.softmax(-1) @ values).transpose(1, 2)  # (B, T, H, D)

    return attend


def _remappable(family: str) -> bool:
    config = family_config(family)
    arch = arch_for(config)
    return not arch.active_extras(config) and arch.norm_after_rotation is None


@pytest.mark.parametrize(
    ("family", "spec"),
    _cases((family, spec) for family in FAMILIES if _remappable(family) for spec in REMAPS),
)
def test_remaps_equal_the_pairwise_definition_full_and_cached(
    family: str, spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = _ids(1, sum(CHUNKS))
    model = family_model(family)
    patch(model, spec)
    with torch.no_grad():
        banded = model(ids, use_cache=False).logits
    cached = _cached_logits(model, ids)
    monkeypatch.setattr(hf_attention, "_banded", _pairwise(REMAPS[spec]))
    with torch.no_grad():
        reference = model(ids, use_cache=False).logits
    torch.testing.assert_close(banded, reference, atol=ATOL, rtol=0)
    torch.testing.assert_close(cached, reference, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", [f for f in FAMILIES if not _remappable(f)])
def test_families_whose_attention_the_bands_cannot_compute_refuse_remaps(family: str) -> None:
    model = family_model(family)
    with pytest.raises(ValueError, match="attends in bands, which do not compute"):
        patch(model, "rerope:window=6,leaky=4")


# ----------------------------------------------------------------------------- layer types
def test_a_spec_changes_the_layer_types_it_names_and_the_others_keep_their_rope() -> None:
    """OLMo 3 (local and global layers on one base): yarn on the local layers only equals
    transformers' model with yarn in those layers' rope_parameters; the spec says so."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    base = family_config("olmo3")
    rope = {**base.rope_parameters}
    rope["sliding_attention"] = {**rope["sliding_attention"], **yarn}
    theirs = family_model("olmo3", rope_parameters=rope, max_position_embeddings=2 * L0)
    ours = family_model("olmo3", max_position_embeddings=2 * L0)
    ours.load_state_dict(theirs.state_dict())
    encoding = patch(ours, "yarn:factor=4,original_length=16,layers=local")
    assert encoding.layers == "sliding_attention"
    assert encoding.spec.endswith(",layers=sliding_attention")
    ids = _ids(2, 48)
    with torch.no_grad():
        expected = theirs(ids, use_cache=False).logits
        torch.testing.assert_close(ours(ids, use_cache=False).logits, expected, atol=ATOL, rtol=0)
    assert patch(ours, encoding.spec).spec == encoding.spec  # the spec rebuilds it
    # the family's default (every rotating type for OLMo 3) is not written out
    assert patch(ours, "yarn:factor=4,original_length=16,layers=all").layers is None


def test_gemma3s_default_extends_the_global_layers_only() -> None:
    model = family_model("gemma3_text")
    encoding = patch(model, "yarn:factor=4")
    assert encoding.layers is None and encoding.base == 1e6  # the global layers' base
    assert patch(model, "yarn:factor=4,layers=global").layers is None
    assert "layers" not in encoding.spec


@pytest.mark.parametrize(
    ("family", "spec", "message"),
    [
        (
            "gemma3_text",
            "yarn:factor=4,layers=all",
            "layer types 'sliding_attention' and 'full_attention' of this gemma3_text model "
            "rotate differently",
        ),
        ("llama", "yarn:factor=4,layers=global+chunked", "no rotating layers of type 'chunked'"),
        ("cohere2", "rope:layers=full_attention", "no rotating layers of type 'full_attention'"),
        ("llama", "yarn:factor=4,layers=Global!", "layers='Global!' is not allowed"),
    ],
)
def test_layer_types_a_model_does_not_have_are_refused_in_one_line(family, spec, message):
    with pytest.raises(ValueError, match=message) as info:
        patch(family_model(family), spec)
    assert "\n" not in str(info.value)


def test_the_reference_decoder_has_one_layer_type() -> None:
    from ropekit.model import Decoder, DecoderConfig

    with pytest.raises(ValueError, match="ropekit's decoder has one layer type"):
        Decoder(DecoderConfig(encoding="yarn:factor=2,original_length=8,layers=global"))
