"""Compare frequency schedules side by side: numbers as JSON, a picture as PNG.

Holds: compare_schedules (pure: spec list -> per-pair inverse frequencies, wavelengths and
the pairs turned past their trained angles at the target length),
plot_schedules (PNG), write_schedules (both files, atomically).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ropekit.encodings import Spec, schedules
from ropekit.results import check_replaceable, run_metadata, write_result

DEFAULT_METHODS = ("rope", "linear", "ntk", "yarn", "llama3")


def method_spec(method: str, factor: float) -> Spec:
    """The spec a method is compared as: one that takes a factor and gives none gets the
    comparison's (LongRoPE, given no long factors, that factor on every pair); the original
    length and base come from the comparison as context."""
    spec = Spec.parse(method)
    if spec.takes("factor") and not spec.gives("factor"):
        spec = spec.with_options(factor=factor)
        if spec.name == "longrope" and not spec.gives("long_factor"):
            spec = spec.with_options(long_factor=(factor,))
    return spec


_FLOAT32_MAX = 3.4028234663852886e38


def compare_schedules(
    methods: list[str] | tuple[str, ...] = DEFAULT_METHODS,
    *,
    head_dim: int = 64,
    base: float = 10000.0,
    factor: float = 8.0,
    original_length: int = 512,
) -> dict[str, Any]:
    """Inverse frequency and wavelength per rotary pair for each method, and the pairs that
    turn past every angle plain RoPE's saw in ``original_length`` tokens when the method reads
    the target length ``factor * original_length`` (``schedules.unseen_rotations``).

    Dynamic schedules are evaluated at the target length.
    """
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim={head_dim} is not allowed; it must be an even integer >= 2")
    if not (math.isfinite(factor) and factor >= 1):
        raise ValueError(f"factor={factor!r} is not allowed; it must be a finite number >= 1")
    if not math.isfinite(factor * original_length):
        raise ValueError(
            f"factor={factor!r} is too large: the target length factor x original_length="
            f"{original_length} is not a finite number"
        )
    if not methods:
        raise ValueError("methods is empty; allowed: one or more methods or specs, e.g. ('rope',)")
    repeated = sorted({m for m in methods if list(methods).count(m) > 1})
    if repeated:
        raise ValueError(f"methods repeat {repeated}; name each method once")
    target = int(factor * original_length)
    rows = []
    for method in methods:
        spec = method_spec(method, factor)
        config = spec.config(base=base, original_length=original_length)
        schedule = config.base_schedule  # learned schedules equal theirs at init
        if schedule is None:
            raise ValueError(f"{spec.name!r} is not a rotary schedule; compare rotary methods only")
        dim = schedule.rotary_dim(head_dim)
        inv_freq, attention_factor = schedule.schedule(dim, target if schedule.dynamic else None)
        trained, _ = schedules.rope(dim, base)
        unseen = schedules.unseen_rotations(inv_freq, trained, target, original_length)
        longest = 2 * math.pi / float(inv_freq[-1]) if float(inv_freq[-1]) > 0 else math.inf
        if not longest < _FLOAT32_MAX:  # models rotate in float32: such a pair never turns
            raise ValueError(
                f"{spec.name!r} with base={schedule.base:g} gives a wavelength of {longest:.3g} "
                f"tokens, past float32's range; allowed: a base whose longest wavelength is "
                f"below {_FLOAT32_MAX:.3g} tokens"
            )
        rows.append(
            {
                "method": method,
                "spec": str(spec),
                "inv_freq": [float(v) for v in inv_freq],
                "wavelength": [2 * math.pi / float(v) for v in inv_freq],
                "attention_factor": float(attention_factor),
                "unseen_pairs": unseen.nonzero().flatten().tolist(),
            }
        )
    return {
        "head_dim": head_dim,
        "base": base,
        "factor": factor,
        "original_length": original_length,
        "target_length": target,
        "methods": rows,
    }


def plot_schedules(result: dict[str, Any], path: Path) -> None:
    """Two panels, one line per method: inverse frequency and wavelength per pair, with the
    original and target lengths marked on the wavelength panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_f, ax_w) = plt.subplots(1, 2, figsize=(11, 4.2))
    for row in result["methods"]:
        pairs = range(len(row["inv_freq"]))
        ax_f.plot(pairs, row["inv_freq"], label=row["spec"], lw=1.6)
        ax_w.plot(pairs, row["wavelength"], label=row["method"], lw=1.6)
    ax_f.set(yscale="log", xlabel="rotary pair f", ylabel="inverse frequency θ_f (rad/token)")
    ax_f.set_title("frequencies")
    ax_w.set(yscale="log", xlabel="rotary pair f", ylabel="wavelength 2π/θ_f (tokens)")
    ax_w.set_title("wavelengths")
    ax_w.axhline(result["original_length"], color="k", ls="--", lw=1, label="original length")
    ax_w.axhline(result["target_length"], color="gray", ls=":", lw=1, label="target length")
    ax_f.legend(fontsize=7)
    ax_w.legend(fontsize=7)
    fig.suptitle(
        f"RoPE schedules: head dim {result['head_dim']}, base {result['base']:g}, "
        f"factor {result['factor']:g}, original length {result['original_length']}"
    )
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


def write_schedules(
    result: dict[str, Any], out_dir: Path, command: str = "", overwrite: bool = False
) -> dict[str, Path]:
    """schedules.json and schedules.png in ``out_dir``; returns their paths. A schedules.json
    of other settings is replaced only with ``overwrite``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "schedules.json", "png": out_dir / "schedules.png"}
    settings = ("head_dim", "base", "factor", "original_length")
    provenance = {k: result[k] for k in settings}
    provenance["methods"] = [row["method"] for row in result["methods"]]
    check_replaceable(paths["json"], "schedules", provenance, overwrite=overwrite)
    meta = run_metadata(command)
    write_result(paths["json"], "schedules", result, meta=meta, provenance=provenance)
    plot_schedules(result, paths["png"])
    return paths
