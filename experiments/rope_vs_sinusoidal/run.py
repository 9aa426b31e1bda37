"""RoPE vs sinusoidal, trained at 512 bytes and evaluated at 1x-16x (the RoPE notes' experiment),
with a RoPE + position-interpolation column; three seeds, mean +- std.

    python -m experiments.rope_vs_sinusoidal.run              # everything (resumes finished jobs)
    python -m experiments.rope_vs_sinusoidal.run --workers 2  # two jobs side by side

Training runs and checkpoints go to runs/experiments/rope_vs_sinusoidal/ (not committed); the
committed results are results.json, results.md, bpb_vs_length.png and the per-run summaries in
summaries/ next to this file.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from experiments.common import (
    check,
    check_data,
    check_ints,
    check_numbers,
    config_dict,
    mean_std,
    parse_args,
    provenance,
    read_record,
    set_field,
    write_record,
    write_results,
)

NAME = "rope_vs_sinusoidal"
PI = "rope + PI"  # the column of the RoPE models scored with position interpolation


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The decoder every run trains (`ropekit pretrain` options)."""

    d_model: int  # model width
    n_layers: int  # decoder blocks
    n_heads: int  # attention heads (head dim = d_model / n_heads)

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads"):
            check_ints(self, name)
        check(
            self.d_model % self.n_heads == 0,
            self,
            "n_heads",
            self.n_heads,
            f"it must divide d_model={self.d_model}",
        )


@dataclasses.dataclass(frozen=True)
class Training:
    """How every run trains (`ropekit pretrain` options): AdamW, warmup then cosine."""

    steps: int  # optimizer steps
    batch_size: int  # sequences of `context` bytes per step
    lr: float  # peak learning rate
    warmup_steps: int  # linear warmup steps

    def __post_init__(self) -> None:
        check_ints(self, "steps")
        check_ints(self, "batch_size")
        check_numbers(self, "lr", low=0)
        check_ints(self, "warmup_steps", minimum=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeVsSinusoidalConfig:
    """The experiment's settings (config.json). Lengths in bytes."""

    encodings: tuple[str, ...]  # encoding specs trained alike; "rope" also gets the PI column
    seeds: tuple[int, ...]  # one run per encoding and seed (initialisation and data order)
    context: int  # training length L; the first evaluation length
    eval_lengths: tuple[int, ...]  # bits per byte at each, on the same held-out bytes
    eval_tokens: int  # held-out target bytes scored per length (non-overlapping windows)
    data: str  # corpus: trained on its training split, scored on its held-out documents
    model: ModelShape
    train: Training
    description: str = ""  # what the experiment asks (for the reader of config.json)

    def __post_init__(self) -> None:
        from ropekit.encodings import Spec

        check_ints(self, "context")
        value = self.encodings
        ok = isinstance(value, list | tuple) and len(value) > 0 and len(set(value)) == len(value)
        check(
            ok and all(isinstance(e, str) for e in value),
            self,
            "encodings",
            value,
            "it must be a non-empty list of distinct encoding specs",
        )
        for spec in value:
            try:
                Spec.parse(spec).config(original_length=self.context)
            except ValueError as e:
                raise ValueError(f"{type(self).__name__}.encodings: {e}") from None
        set_field(self, "encodings", tuple(value))
        check_ints(self, "seeds", minimum=0, many=True, distinct=True)
        check_ints(self, "eval_lengths", many=True, distinct=True)
        # The PI column is plain RoPE at 1x and interpolates every longer length from L.
        check(
            self.eval_lengths[0] == self.context,
            self,
            "eval_lengths",
            self.eval_lengths,
            f"it must start at context={self.context}",
        )
        check_ints(self, "eval_tokens")
        check_data(self, "data")
        for name, kind in (("model", ModelShape), ("train", Training)):
            check(
                isinstance(getattr(self, name), kind),
                self,
                name,
                getattr(self, name),
                f"it must be a {kind.__name__}",
            )


def job_dir(runs: Path, encoding: str, seed: int) -> Path:
    return runs / f"{encoding}-s{seed}"


def train_job(cfg: RopeVsSinusoidalConfig, runs: Path, encoding: str, seed: int) -> None:
    """`ropekit pretrain` in a subprocess, one thread (two jobs share the two cores)."""
    out = job_dir(runs, encoding, seed)
    if (out / "pretrain.json").exists():
        return
    t, m = cfg.train, cfg.model
    cmd = [
        sys.executable, "-m", "ropekit.cli", "pretrain",
        "--encoding", encoding,
        "--context", str(cfg.context),
        "--data", cfg.data,
        "--out", str(out),
        "--d-model", str(m.d_model),
        "--layers", str(m.n_layers),
        "--heads", str(m.n_heads),
        "--steps", str(t.steps),
        "--batch-size", str(t.batch_size),
        "--lr", str(t.lr),
        "--warmup", str(t.warmup_steps),
        "--seed", str(seed),
        "--resume",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env)


def eval_job(cfg: RopeVsSinusoidalConfig, runs: Path, encoding: str, seed: int) -> dict:
    """bpb at every length (same held-out bytes for each), and for RoPE also with PI; cached in
    the run's eval.json."""
    import torch

    from ropekit.evals.perplexity import PerplexityConfig, run_perplexity
    from ropekit.model import Decoder, load_decoder

    torch.set_num_threads(1)
    out = job_dir(runs, encoding, seed)
    path = out / "eval.json"
    if path.exists():
        return read_record(path)
    model = load_decoder(out / "model").eval()
    common = {"tokenizer": "bytes", "data": cfg.data, "progress": False}
    config = PerplexityConfig(cfg.eval_lengths, n_tokens=cfg.eval_tokens)
    res = run_perplexity(model, config, out / "ppl", spec=encoding, **common).result
    row = {
        "encoding": encoding,
        "seed": seed,
        "bpb": {r.length: r.bits_per_byte for r in res.results},
    }
    if encoding == "rope":
        # PI divides every position by (eval length / training length), so angles stay inside
        # the trained range; at 1x it is plain RoPE.
        row["pi_bpb"] = {cfg.context: row["bpb"][cfg.context]}
        for length in cfg.eval_lengths[1:]:
            factor = length / cfg.context
            pi = Decoder(dataclasses.replace(model.config, encoding=f"linear:factor={factor:g}"))
            pi.load_state_dict(model.state_dict())
            r = run_perplexity(
                pi.eval(),
                PerplexityConfig((length,), n_tokens=cfg.eval_tokens),
                out / f"ppl-pi-{length}",
                spec=f"linear:factor={factor:g}",
                **common,
            )
            row["pi_bpb"][length] = r.result.at(length).bits_per_byte
    write_record(path, row)
    return row


def unigram_bpb(data: str) -> float:
    """Bits per byte of a byte-unigram model fitted on the training split: the floor a model
    that ignores context would reach."""
    from ropekit.data import load_documents

    train = Counter()
    for doc in load_documents(data, "train"):
        train.update(doc.text.encode("utf-8"))
    total = sum(train.values())
    held = Counter()
    for doc in load_documents(data, "validation"):
        held.update(doc.text.encode("utf-8"))
    n = sum(held.values())
    # add-one smoothing over 256 byte values
    return -sum(c * math.log2((train[b] + 1) / (total + 256)) for b, c in held.items()) / n


SUMMARY_KEYS = (
    "encoding", "parameters", "tokens", "elapsed_s", "tokens_per_s", "mfu",
    "matmul_flops_per_s", "final_loss",
)  # fmt: skip


def aggregate(cfg: RopeVsSinusoidalConfig, runs: Path, rows: list[dict]) -> dict:
    from ropekit.results import read_result

    columns: dict[str, list] = {e: [] for e in cfg.encodings}
    if "rope" in columns:
        columns[PI] = []
    for row in rows:
        columns[row["encoding"]].append(row["bpb"])
        if "pi_bpb" in row:
            columns[PI].append(row["pi_bpb"])
    table = {}
    for name, scored in columns.items():
        table[name] = {}
        for length in cfg.eval_lengths:
            # A fresh row is keyed by int length, one read back from eval.json by str.
            vals = [float(r[str(length)] if str(length) in r else r[length]) for r in scored]
            m, s = mean_std(vals)
            table[name][str(length)] = {"mean": m, "std": s, "values": vals}
    summaries = [
        read_result(job_dir(runs, e, s) / "pretrain.json", "pretrain")
        for e in cfg.encodings
        for s in cfg.seeds
    ]
    return {
        "config": config_dict(cfg),
        "bits_per_byte": table,
        "unigram_bpb": unigram_bpb(cfg.data),
        "runs": [{k: s[k] for k in SUMMARY_KEYS} | {"seed": s["train"]["seed"]} for s in summaries],
    }


def write_outputs(
    cfg: RopeVsSinusoidalConfig, result: dict[str, Any], results: Path, *, command: str
) -> str:
    """The figure, results.md, results.json and summaries/ in ``results``; returns the table."""
    from ropekit.figures import plot_vs_length

    lengths = cfg.eval_lengths
    columns = result["bits_per_byte"]
    plot_vs_length(
        {name: {n: col[str(n)]["mean"] for n in lengths} for name, col in columns.items()},
        results / "bpb_vs_length.png",
        ylabel="validation bits per byte",
        title=f"Trained at {cfg.context} bytes: quality vs length "
        f"(mean ± std, {len(cfg.seeds)} seeds)",
        errors={name: {n: col[str(n)]["std"] for n in lengths} for name, col in columns.items()},
        train_length=cfg.context,
        xlabel="evaluation length (bytes)",
        size=(6.5, 4.2),
    )
    lines = [
        "| column | " + " | ".join(f"{n}" for n in lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]
    for name, col in columns.items():
        cells = [f"{col[str(n)]['mean']:.3f} ± {col[str(n)]['std']:.3f}" for n in lengths]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    write_results(results, result, text, command=command, provenance=provenance(NAME, cfg))
    for run in result["runs"]:
        write_record(results / "summaries" / f"{run['encoding']}-s{run['seed']}.json", run)
    return text


def run(
    cfg: RopeVsSinusoidalConfig, runs: Path, results: Path, command: str, workers: int = 1
) -> str:
    """Train every run, then score them (finished jobs are reused), ``workers`` at a time;
    then the results. Returns the table."""
    jobs = [(e, s) for s in cfg.seeds for e in cfg.encodings]
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda j: train_job(cfg, runs, *j), jobs))
    # Import transformers' lazy modules once here: two threads resolving them at once race.
    from transformers import PreTrainedModel  # noqa: F401

    with ThreadPoolExecutor(workers) as pool:
        rows = list(pool.map(lambda j: eval_job(cfg, runs, *j), jobs))
    return write_outputs(cfg, aggregate(cfg, runs, rows), results, command=command)


def main(argv: Sequence[str] | None = None) -> None:
    invocation = parse_args(NAME, __doc__, RopeVsSinusoidalConfig, argv, workers=True)
    args = (invocation.config, invocation.runs, invocation.results, invocation.command)
    print(run(*args, workers=invocation.workers))
    print(f"results in {invocation.results}")


if __name__ == "__main__":
    main()
