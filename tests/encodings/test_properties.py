"""Properties every rotary encoding must have, AdaRoPE with random (non-initial) parameters
included: relative-position invariance, norm preservation, identity at position 0, default
positions, packed batches."""

from __future__ import annotations

import torch

from ropekit.encodings import AdaRoPE, PositionEncoding, build

from .conftest import SHAPE, perturb


def _unscaled_q(enc: PositionEncoding, q: torch.Tensor, pos: torch.Tensor, layer: int):
    """rotate_q with its query temperature factored out (AdaScale's, sec. 3.3 of the paper, or
    a fixed one: it depends on absolute length by design)."""
    out = enc.rotate_q(q, pos, layer)
    temperature = enc.query_temperature(pos, layer)
    return out if temperature is None else out / temperature


def _attention_factor(enc: PositionEncoding, pos: torch.Tensor) -> float | torch.Tensor:
    if isinstance(enc, AdaRoPE):
        return enc.attention_factor
    if hasattr(enc, "inv_freq"):
        return enc.inv_freq(0)[1]
    length = int(pos.max()) + 1
    return enc.frequencies(length)[1]


def _scores(enc, q, k, qpos, kpos, layer):
    # q (1, H, T, D), k (1, K, T, D): scores of query t with key t, per query head.
    rq = _unscaled_q(enc, q, qpos, layer)
    rk = enc.rotate_k(k, kpos, layer)
    rk = rk.repeat_interleave(enc.n_heads // enc.n_kv_heads, dim=1)
    return (rq * rk).sum(-1)  # (1, H, T)


def test_scores_depend_only_on_offset(rotary):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, SHAPE["n_heads"], 1, SHAPE["head_dim"], generator=g, dtype=torch.float64)
    k = torch.randn(1, SHAPE["n_kv_heads"], 1, SHAPE["head_dim"], generator=g, dtype=torch.float64)
    pairs = [(5, 8), (8, 5), (0, 37), (1000, 3), (4321, 4321)]
    shifts = [0, 17, 1_000, 99_000]
    # All positions go through one call so length-following schedules (dynamic NTK,
    # LongRoPE) use one set of frequencies: invariance holds within a forward.
    qpos = torch.tensor([[m + s for m, _ in pairs for s in shifts]])
    kpos = torch.tensor([[n + s for _, n in pairs for s in shifts]])
    n = qpos.shape[1]
    s = _scores(rotary, q.expand(-1, -1, n, -1), k.expand(-1, -1, n, -1), qpos, kpos, layer=2)
    s = s.view(1, -1, len(pairs), len(shifts))
    torch.testing.assert_close(s, s[..., :1].expand_as(s), rtol=1e-9, atol=1e-9)
    # ...and a different offset gives a different score.
    assert (s[:, :, 0, 0] - s[:, :, 2, 0]).abs().max() > 1e-3


def test_rotation_preserves_norm(rotary):
    x = torch.randn(2, SHAPE["n_kv_heads"], 50, SHAPE["head_dim"], dtype=torch.float64)
    pos = torch.randint(0, 100_000, (2, 50))
    out = rotary.rotate_k(x, pos, layer=1)
    rot = rotary.rotary_dim
    factor = _attention_factor(rotary, pos)
    torch.testing.assert_close(
        out[..., :rot].norm(dim=-1), factor * x[..., :rot].norm(dim=-1), rtol=1e-10, atol=1e-10
    )
    torch.testing.assert_close(out[..., rot:], x[..., rot:], rtol=0, atol=0)


def test_position_zero_is_identity(rotary):
    k = torch.randn(1, SHAPE["n_kv_heads"], 1, SHAPE["head_dim"], dtype=torch.float64)
    q = torch.randn(1, SHAPE["n_heads"], 1, SHAPE["head_dim"], dtype=torch.float64)
    zero = torch.zeros(1, 1, dtype=torch.long)
    factor = _attention_factor(rotary, zero)
    rot = rotary.rotary_dim
    expected_k = torch.cat((k[..., :rot] * factor, k[..., rot:]), dim=-1)
    torch.testing.assert_close(rotary.rotate_k(k, zero), expected_k, rtol=1e-12, atol=1e-12)
    expected_q = torch.cat((q[..., :rot] * factor, q[..., rot:]), dim=-1)
    torch.testing.assert_close(_unscaled_q(rotary, q, zero, 0), expected_q, rtol=1e-12, atol=1e-12)


def test_explicit_arange_equals_default(rotary):
    q = torch.randn(2, SHAPE["n_heads"], 9, SHAPE["head_dim"], dtype=torch.float64)
    k = torch.randn(2, SHAPE["n_kv_heads"], 9, SHAPE["head_dim"], dtype=torch.float64)
    pos = torch.arange(9)[None].expand(2, -1)
    torch.testing.assert_close(
        rotary.rotate_q(q, pos, 1), rotary.rotate_q(q, None, 1), rtol=0, atol=0
    )
    torch.testing.assert_close(
        rotary.rotate_k(k, pos, 1), rotary.rotate_k(k, None, 1), rtol=0, atol=0
    )


def test_packed_batch_equals_separate_runs(rotary):
    if rotary.dynamic:
        return  # frequencies follow each call's length; packing changes that length by design
    q = torch.randn(2, SHAPE["n_heads"], 7, SHAPE["head_dim"], dtype=torch.float64)
    pos = torch.stack((torch.arange(7), torch.arange(7) + 12_345))
    together = rotary.rotate_q(q, pos, 2)
    for b in range(2):
        alone = rotary.rotate_q(q[b : b + 1], pos[b : b + 1], 2)
        torch.testing.assert_close(together[b : b + 1], alone, rtol=0, atol=0)


def test_adarope_at_init_equals_its_base_schedule():
    for init, extra in [
        ("rope", ""),
        ("yarn", ",factor=8,original_length=64"),
        ("linear", ",factor=4"),
        ("ntk", ",factor=4"),
        ("llama3", ",factor=8,original_length=64"),
    ]:
        base_spec = init + (":" + extra[1:] if extra else "")
        ada = build(f"adarope:init={init}{extra}", **SHAPE)
        base = build(base_spec, **SHAPE)
        q = torch.randn(2, SHAPE["n_heads"], 300, SHAPE["head_dim"])
        k = torch.randn(2, SHAPE["n_kv_heads"], 300, SHAPE["head_dim"])
        pos = torch.arange(300)[None] + torch.tensor([[0], [5000]])
        for layer in range(SHAPE["n_layers"]):
            torch.testing.assert_close(ada.rotate_q(q, pos, layer), base.rotate_q(q, pos, layer))
            torch.testing.assert_close(ada.rotate_k(k, pos, layer), base.rotate_k(k, pos, layer))


def test_adarope_sharing_options_set_parameter_shapes():
    shapes = {
        "adarope": ((3, 2, 8), (3, 4)),
        "adarope:share_heads=true": ((3, 1, 8), (3, 1)),
        "adarope:share_layers=true": ((1, 2, 8), (1, 4)),
        "adarope:share_heads=true,share_layers=true": ((1, 1, 8), (1, 1)),
    }
    for spec, (xi, scale) in shapes.items():
        enc = build(spec, **SHAPE)
        assert tuple(enc.dxi.shape) == xi and tuple(enc.gamma.shape) == scale
        assert set(enc.positional_parameters()) == {"dxi", "log_tau", "gamma"}
    assert set(build("adarope:freq=false", **SHAPE).positional_parameters()) == {"log_tau", "gamma"}
    assert set(build("adarope:scale=false", **SHAPE).positional_parameters()) == {"dxi"}


class _Probe(torch.nn.Module):
    """forward() wrapper so torch.func.functional_call can swap the encoding's parameters."""

    def __init__(self, encoding: PositionEncoding) -> None:
        super().__init__()
        self.encoding = encoding

    def forward(self, q, k, pos):
        return self.encoding.rotate_q(q, pos, 1), self.encoding.rotate_k(k, pos, 2)


def test_adarope_gradcheck_float64():
    """Gradients w.r.t. log-frequencies, log-temperature and gamma match finite differences."""
    enc = perturb(build("adarope:init=yarn,factor=4,original_length=8,l_ref=4", **SHAPE)).double()
    probe = _Probe(enc)
    q = torch.randn(1, 4, 6, 16, dtype=torch.float64)
    k = torch.randn(1, 2, 6, 16, dtype=torch.float64)
    pos = torch.tensor([[0, 3, 9, 17, 40, 101]])
    names = ("encoding.dxi", "encoding.log_tau", "encoding.gamma")
    params = tuple(
        dict(probe.named_parameters())[n].detach().clone().requires_grad_() for n in names
    )

    def f(*values):
        return torch.func.functional_call(probe, dict(zip(names, values, strict=True)), (q, k, pos))

    assert torch.autograd.gradcheck(f, params)


def test_tuned_yarn_at_init_equals_untruncated_yarn_and_has_gradients():
    tuned = build("tuned-yarn:factor=8,original_length=64", **SHAPE).double()
    yarn = build("yarn:factor=8,original_length=64,truncate=false", **SHAPE).double()
    k = torch.randn(1, 2, 20, 16, dtype=torch.float64)
    pos = torch.arange(20)[None] * 37
    torch.testing.assert_close(
        tuned.rotate_k(k, pos), yarn.rotate_k(k, pos), rtol=1e-12, atol=1e-12
    )
    # At realistic sizes both ramp ends lie inside the pair range, so every knob has a gradient
    # (at tiny sizes beta_fast's end clamps at pair 0, correctly giving it none).
    tuned = build("tuned-yarn:factor=8,original_length=4096", n_heads=2, head_dim=64).double()
    k = torch.randn(1, 2, 20, 64, dtype=torch.float64)
    # A rotation keeps norms, so a loss such as ||R k||^2 has zero gradient for every frequency
    # knob (only the attention factor scales the norm); project on a fixed direction instead.
    w = torch.randn(1, 2, 20, 64, dtype=torch.float64)
    (tuned.rotate_k(k, pos * 100) * w).sum().backward()
    for name, p in tuned.named_parameters():
        assert p.grad is not None and p.grad.abs() > 0, name


def test_absolute_and_bias_encodings_leave_q_k_alone():
    for spec in ("nope", "alibi", "sinusoidal", "learned:max_length=64"):
        enc = perturb(build(spec, **SHAPE))
        q = torch.randn(1, 4, 5, 16)
        assert torch.equal(enc.rotate_q(q, None, 0), q)
