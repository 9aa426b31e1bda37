"""The typed encoding surface: what every encoding declares agrees with what it does, the typed
accessors (base schedule, base, factor, original length) say the right thing, and configs
whose spec would not rebuild them are refused. (AdaRoPE's temperature and head rows:
test_adarope.py; frequencies that follow the length: test_rope.py.)"""

from __future__ import annotations

import pytest
import torch

from ropekit.encodings import build, names
from ropekit.encodings.base import check_rebuilds_from_spec
from ropekit.encodings.registry import Spec
from ropekit.encodings.rope import LongRopeConfig, RotaryEncoding, YarnConfig

from .conftest import SHAPE, perturb

# One spec per registered encoding, and what each must declare:
# (adds_to_embeddings, has_score_bias, layer_independent_bias, dynamic, learned_frequencies,
#  rotates); distance remaps are listed in REMAPS.
DECLARED = {
    "nope": ("nope", (False, False, False, False, False, False)),
    "sinusoidal": ("sinusoidal", (True, False, False, False, False, False)),
    "learned": ("learned:max_length=64", (True, False, False, False, False, False)),
    "alibi": ("alibi", (False, True, True, False, False, False)),
    "rope": ("rope", (False, False, False, False, False, True)),
    "linear": ("linear:factor=4", (False, False, False, False, False, True)),
    "ntk": ("ntk:factor=4", (False, False, False, False, False, True)),
    "proportional": ("proportional:proportion=0.5", (False, False, False, False, False, True)),
    "dynamic-ntk": (
        "dynamic-ntk:factor=4,original_length=16",
        (False, False, False, True, False, True),
    ),
    "yarn": ("yarn:factor=4,original_length=16", (False, False, False, False, False, True)),
    "llama3": ("llama3:factor=4,original_length=16", (False, False, False, False, False, True)),
    "longrope": (
        "longrope:factor=4,original_length=16,long_factor=[2],short_factor=[1.5]",
        (False, False, False, True, False, True),
    ),
    "cope": ("cope", (False, False, False, False, False, True)),
    "hardclip": ("hardclip:clip=2", (False, False, False, False, False, True)),
    "harpe": ("harpe:factor=4", (False, False, False, False, False, True)),
    "adarope": ("adarope", (False, False, False, False, True, True)),
    "tuned-yarn": (
        "tuned-yarn:factor=4,original_length=16",
        (False, False, False, False, True, True),
    ),
    "mixed": (
        "mixed:method=adarope,init=yarn,factor=4,original_length=4",
        (False, False, False, True, True, True),
    ),
    "rerope": ("rerope:window=2", (False, False, False, False, False, True)),
    "self-extend": ("self-extend:group=2,window=2", (False, False, False, False, False, True)),
    "dca": ("dca:chunk_size=3,local_size=1,scale=none", (False, False, False, False, False, True)),
    "string": ("string:shift=2,window=1", (False, False, False, False, False, True)),
    # the length-following variants: DCA's scale beyond L0, STRING's shift of 0.33 x the length
    "dca scaled": (
        "dca:chunk_size=3,local_size=1,original_length=4",
        (False, False, False, True, False, True),
    ),
    "string following": ("string:window=1", (False, False, False, True, False, True)),
    "adarope-remap": (
        "adarope-remap:remap=rerope,window=2,leaky=2",
        (False, False, False, False, True, True),
    ),
    # a fixed temperature declares what it wraps (here a remap); its learned s is no frequency
    "temperature": (
        "temperature:rule=ssmax,learn=true,method=rerope,window=2,original_length=4",
        (False, False, False, False, False, True),
    ),
}
REMAPS = {"rerope", "self-extend", "dca", "string", "temperature", "adarope-remap"}


def test_the_table_covers_the_registry():
    assert {name.split()[0] for name in DECLARED} == set(names())


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_declarations_agree_with_behaviour(name):
    spec, (embeds, biased, shared, dynamic, learned, rotates) = DECLARED[name]
    enc = perturb(build(spec, **SHAPE))
    assert (
        enc.adds_to_embeddings,
        enc.has_score_bias,
        enc.layer_independent_bias,
        enc.dynamic,
        enc.learned_frequencies,
        enc.rotary_dim > 0,
    ) == (embeds, biased, shared, dynamic, learned, rotates)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, 6, 4 * SHAPE["head_dim"], generator=g)
    pos = torch.arange(3, 9)[None]
    assert (not torch.equal(enc.embed(h, pos), h)) == embeds
    bias = enc.score_bias(pos, pos, 1)
    assert (bias is not None) == biased
    if biased:
        assert torch.equal(bias, enc.score_bias(pos, pos, 2)) == shared
    q = torch.randn(1, SHAPE["n_heads"], 6, SHAPE["head_dim"], generator=g)
    assert (not torch.equal(enc.rotate_q(q, pos, 1), q)) == rotates
    assert enc.remaps_distance == (name.split()[0] in REMAPS)
    assert (len(enc.bands(pos, pos, 1)) > 1) == (name.split()[0] in REMAPS)
    if rotates:
        assert enc.pairing in ("half", "interleaved")
        assert enc.n_pairs == enc.rotary_dim // 2 and enc.base_schedule is not None
        theta = enc.inv_freq(1, 64)[0]
        assert theta.dtype == torch.float64 and theta.shape[-1] == enc.n_pairs
        assert theta.shape[0] in (1, SHAPE["n_kv_heads"])
        torch.testing.assert_close(enc.log_frequencies(1, 64), theta.log())
    else:
        assert (enc.pairing, enc.n_pairs, enc.base_schedule, enc.base) == (None, 0, None, None)
        with pytest.raises(ValueError, match="does not rotate"):
            enc.inv_freq(0)


@pytest.mark.parametrize(
    ("spec", "base", "factor", "original_length"),
    [
        ("rope:base=500000", 500000.0, None, None),
        ("linear:factor=4", 10000.0, 4.0, None),
        ("ntk:factor=2,base=1000", 1000.0, 2.0, None),
        ("yarn:factor=8,original_length=512", 10000.0, 8.0, 512),
        ("dynamic-ntk:factor=2,original_length=64", 10000.0, 2.0, 64),
        ("longrope:factor=4,original_length=64", 10000.0, 4.0, 64),
        ("adarope:init=yarn,factor=8,original_length=512,base=1e6", 1e6, 8.0, 512),
        ("adarope", 10000.0, None, None),
        ("tuned-yarn:factor=2,original_length=32", 10000.0, 2.0, 32),
        ("alibi", None, None, None),
        ("nope", None, None, None),
        # a distance remap: its base schedule's base and factor, its own L0
        ("rerope", 10000.0, None, None),
        ("dca:original_length=4096,init=linear,factor=2,base=500000", 500000.0, 2.0, 4096),
        ("string:init=yarn,factor=4,original_length=64", 10000.0, 4.0, 64),
    ],
)
def test_base_factor_and_original_length_come_from_the_base_schedule(
    spec, base, factor, original_length
):
    enc = build(spec, **SHAPE)
    assert (enc.base, enc.factor, enc.original_length) == (base, factor, original_length)


def test_base_schedule_is_the_fixed_schedule_an_encoding_starts_from():
    ada = build("adarope:init=linear,factor=4", **SHAPE)
    assert ada.base_schedule == build("linear:factor=4", **SHAPE).config
    tuned = build("tuned-yarn:factor=4,original_length=16", **SHAPE)
    assert tuned.base_schedule is tuned.config  # its knobs start at this yarn schedule
    rope = build("rope", **SHAPE)
    assert rope.base_schedule is rope.config


# ----------------------------------------------------------------------------- spec round trips
def test_a_config_its_spec_cannot_rebuild_is_refused_naming_the_option():
    dims = {"n_heads": 2, "n_kv_heads": 2, "head_dim": 16, "n_layers": 1, "d_model": 32}
    with pytest.raises(ValueError, match="original_length") as info:
        RotaryEncoding(YarnConfig(factor=2.0, original_length=512.5), **dims)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="long_factor"):
        config = LongRopeConfig(
            factor=2.0, original_length=64, long_factor=[1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
        )
        RotaryEncoding(config, **dims)
    # The same values written the way a spec reads them build.
    RotaryEncoding(YarnConfig(factor=2.0, original_length=512), **dims)
    RotaryEncoding(LongRopeConfig(factor=2.0, original_length=64, long_factor=(2.0,) * 8), **dims)


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_every_encoding_rebuilds_from_its_spec(name):
    enc = perturb(build(DECLARED[name][0], **SHAPE))
    again = build(enc.spec, **SHAPE)
    assert again.config == enc.config and again.spec == enc.spec


@pytest.mark.parametrize("name", ["nope", "sinusoidal", "learned", "alibi"])
def test_a_config_that_does_not_rotate_has_no_extension(name):
    """Asking an encoding that does not rotate for its base or factor names it and says why."""
    config = build(DECLARED[name][0], **SHAPE).config
    with pytest.raises(ValueError, match=f"'{name}' is not a rotary schedule; it has no base"):
        config.extension()


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_the_parsed_schedule_is_not_an_option_a_spec_can_name(name):
    """Encodings that hold an inner schedule (AdaRoPE, the remaps, mixed) keep it in a field
    ``schedule`` parsed from their other options; a spec cannot give it."""
    spec = Spec.parse(DECLARED[name][0])
    assert not spec.takes("schedule")
    assert all(spec.takes(option) for option in spec.given)


def test_rotate_band_rotates_at_the_layer_it_is_given():
    """The band rotation of an encoding with per-layer frequencies (AdaRoPE) is that layer's
    rotate_q / rotate_k, which differ between layers."""
    enc = perturb(build("adarope", **SHAPE)).double()
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, SHAPE["n_heads"], 5, SHAPE["head_dim"], generator=g, dtype=torch.float64)
    k = torch.randn(1, SHAPE["n_kv_heads"], 5, SHAPE["head_dim"], generator=g, dtype=torch.float64)
    pos = torch.arange(3, 8)[None]
    for layer in range(SHAPE["n_layers"]):
        assert torch.equal(enc.rotate_band(q, pos, True, layer), enc.rotate_q(q, pos, layer))
        assert torch.equal(enc.rotate_band(k, pos, False, layer), enc.rotate_k(k, pos, layer))
    assert not torch.allclose(enc.rotate_q(q, pos, 1), enc.rotate_q(q, pos, 0))


@pytest.mark.parametrize(
    "spec", ["rope", "yarn:factor=4,original_length=16", "tuned-yarn:factor=4,original_length=16"]
)
def test_log_frequencies_default_to_the_first_layer(spec):
    """``log_frequencies()`` is layer 0's, also in a one-layer model (where layer 1 is out of
    range)."""
    enc = perturb(build(spec, **{**SHAPE, "n_layers": 1}))
    torch.testing.assert_close(enc.log_frequencies(), enc.inv_freq(0)[0].log())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool])
def test_positions_must_be_an_integer_tensor(dtype):
    """Fractional or boolean positions are refused by name (a float position would silently
    rotate at positions the model never saw; a mask passed as positions, at 0 and 1)."""
    enc = build("rope", **SHAPE)
    q = torch.zeros(1, SHAPE["n_heads"], 3, SHAPE["head_dim"])
    with pytest.raises(ValueError, match=f"positions must be an integer tensor, got {dtype}"):
        enc.rotate_q(q, torch.zeros(1, 3, dtype=dtype))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_default_positions_live_on_the_device_of_the_queries():
    """Without positions, 0..T-1 are made on q's device: on CUDA rotate_q(q) is rotate_q at
    those positions."""
    enc = build("rope", **SHAPE).to("cuda")
    q = torch.randn(1, SHAPE["n_heads"], 5, SHAPE["head_dim"], device="cuda")
    positions = torch.arange(5, device="cuda")[None]
    torch.testing.assert_close(enc.rotate_q(q), enc.rotate_q(q, positions), rtol=0, atol=0)


@pytest.mark.parametrize(
    "text, value",
    [(t, True) for t in ("1", "true", "yes", "on", "TRUE", "Yes", "ON")]
    + [(t, False) for t in ("0", "false", "no", "off", "FALSE", "No", "OFF")],
)
def test_every_documented_boolean_spelling_parses_in_any_case(text, value):
    """A boolean option takes 1/true/yes/on and 0/false/no/off, case-insensitively."""
    from ropekit.encodings.base import _parse_scalar

    assert _parse_scalar(text, bool, "flag") is value


@pytest.mark.parametrize(
    "value, text",
    [
        (True, "true"),
        (False, "false"),
        ((True, 2.0), "[true,2]"),
        (1e15 - 1, "999999999999999"),  # integer-valued floats below 10^15 print as integers
        (1e15, "1000000000000000.0"),  # from 10^15 on, as Python prints the float
        (-1e15, "-1000000000000000.0"),
        (0.5, "0.5"),
    ],
)
def test_format_value_writes_options_as_a_spec_spells_them(value, text):
    """Booleans in lower case (as specs are written), tuples as bracketed lists, and the
    10^15 edge past which an integer-valued float keeps its float form."""
    from ropekit.encodings.base import format_value

    assert format_value(value) == text


@pytest.mark.parametrize("text", ["none", "None", "NONE", "null", "NULL", ""])
def test_an_optional_option_reads_none_null_or_nothing_as_unset(text):
    from ropekit.encodings.base import EncodingConfig

    assert EncodingConfig.parse_value("factor", text, float | None) is None


@pytest.mark.parametrize("text, value", [("[1,2]", (1, 2)), ("1;2", (1, 2)), (" [3] ", (3,))])
def test_a_list_option_takes_brackets_or_none(text, value):
    from ropekit.encodings.base import EncodingConfig

    assert EncodingConfig.parse_value("xs", text, tuple[int, ...]) == value


@pytest.mark.parametrize("text", ["[1,2", "1,2]"])
def test_a_list_option_with_one_bracket_is_refused(text):
    from ropekit.encodings.base import EncodingConfig

    with pytest.raises(ValueError, match=r"xs='.*' is not an integer"):
        EncodingConfig.parse_value("xs", text, tuple[int, ...])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "longrope:factor=4,original_length=64,long_factor=[1,2",
            "spec 'longrope:factor=4,original_length=64,long_factor=[1,2' has an unmatched '['",
        ),
        ("rope:base=1]", "spec 'rope:base=1]' has an unmatched ']'"),
        ("rope:base=1=2", "spec 'rope:base=1=2': base='1=2' is not a number"),
        ("rope:=5", "option '=5' in spec 'rope:=5' must look like key=value"),
        ("rope:base", "option 'base' in spec 'rope:base' must look like key=value"),
        (
            "longrope:factor=4,original_length=64,long_factor=[[1]]",
            "spec 'longrope:factor=4,original_length=64,long_factor=[[1]]': long_factor='[1]' is "
            "not a number",
        ),
        (
            "rope:bsae=10",
            "spec 'rope:bsae=10': unknown option 'bsae' for RopeConfig; allowed: base, pairing, "
            "fraction, proportion",
        ),
        (
            "longrope:factor=4,original_length=64,long_factor=[]",
            "spec 'longrope:factor=4,original_length=64,long_factor=[]': long_factor='[]' is an "
            "empty list",
        ),
    ],
)
def test_malformed_specs_are_refused_by_their_whole_message(spec, message):
    """The text of a spec is read as written: brackets nest and must close, an option is
    key=value split at its first '=', and each message quotes the spec it is about."""
    with pytest.raises(ValueError) as info:
        build(spec, **SHAPE)
    assert str(info.value) == message


def test_a_config_its_spec_does_not_rebuild_is_refused_naming_the_option_and_its_type():
    """Given in Python as a list where a spec rebuilds a tuple, or as a number a spec cannot
    write: refused, naming the option (the ones before it rebuild equal)."""
    listed = LongRopeConfig(
        factor=4.0, original_length=64, short_factor=(1.0, 1.5), long_factor=[2.0, 3.0]
    )
    with pytest.raises(ValueError) as info:
        check_rebuilds_from_spec(listed)
    assert str(info.value) == (
        "long_factor=[2.0, 3.0] does not survive its spec: 'longrope:short_factor=[1,1.5],"
        "long_factor=[2.0, 3.0],original_length=64,factor=4' rebuilds long_factor=(2.0, 3.0); "
        "give long_factor as tuple"
    )
    with pytest.raises(ValueError) as info:
        check_rebuilds_from_spec(YarnConfig(factor=4.0, original_length=512.5))
    assert str(info.value) == (
        "this config cannot be written as a spec ('yarn:factor=4,original_length=512.5': "
        "original_length='512.5' is not an integer)"
    )


def test_a_field_type_specs_cannot_say_is_named():
    from ropekit.encodings.base import EncodingConfig

    with pytest.raises(TypeError) as info:
        EncodingConfig.parse_value("x", "1", int | str)
    assert str(info.value) == "unsupported field type int | str for x"
