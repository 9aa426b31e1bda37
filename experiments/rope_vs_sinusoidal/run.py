"""RoPE vs sinusoidal, trained at 512 bytes and evaluated at 1x-16x (the RoPE notes' experiment),
with a RoPE + position-interpolation column; three seeds, mean +- std.

    python experiments/rope_vs_sinusoidal/run.py            # everything (resumes finished jobs)
    python experiments/rope_vs_sinusoidal/run.py --workers 2

Training runs and checkpoints go to runs/experiments/rope_vs_sinusoidal/ (not committed); the
committed results are results.json, results.md, bpb_vs_length.png and the per-run summaries in
summaries/ next to this file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = Path("runs/experiments/rope_vs_sinusoidal")


def job_dir(encoding: str, seed: int) -> Path:
    return RUNS / f"{encoding}-s{seed}"


def train_job(cfg: dict, encoding: str, seed: int) -> None:
    """`ropekit pretrain` in a subprocess, one thread (two jobs share the two cores)."""
    out = job_dir(encoding, seed)
    if (out / "pretrain.json").exists():
        return
    t, m = cfg["train"], cfg["model"]
    cmd = [
        sys.executable,
        "-m",
        "ropekit.cli",
        "pretrain",
        "--encoding",
        encoding,
        "--context",
        str(cfg["context"]),
        "--data",
        cfg["data"],
        "--out",
        str(out),
        "--d-model",
        str(m["d_model"]),
        "--layers",
        str(m["n_layers"]),
        "--heads",
        str(m["n_heads"]),
        "--steps",
        str(t["steps"]),
        "--batch-size",
        str(t["batch_size"]),
        "--lr",
        str(t["lr"]),
        "--warmup",
        str(t["warmup_steps"]),
        "--seed",
        str(seed),
        "--resume",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env)


def eval_job(cfg: dict, encoding: str, seed: int) -> dict:
    """bpb at every length (same held-out bytes for each), and for RoPE also with PI."""
    import torch

    from ropekit.evals.perplexity import PerplexityConfig, run_perplexity
    from ropekit.model import Decoder, load_decoder

    torch.set_num_threads(1)
    out = job_dir(encoding, seed)
    path = out / "eval.json"
    if path.exists():
        return json.loads(path.read_text())
    model = load_decoder(out / "model").eval()
    common = {"tokenizer": "bytes", "data": cfg["data"], "progress": False}
    config = PerplexityConfig(tuple(cfg["eval_lengths"]), n_tokens=cfg["eval_tokens"])
    res = run_perplexity(model, config, out / "ppl", spec=encoding, **common)
    row = {
        "encoding": encoding,
        "seed": seed,
        "bpb": {r["length"]: r["bits_per_byte"] for r in res["results"]},
    }
    if encoding == "rope":
        # PI divides every position by (eval length / training length), so angles stay inside
        # the trained range; at 1x it is plain RoPE.
        row["pi_bpb"] = {cfg["context"]: row["bpb"][cfg["context"]]}
        for length in cfg["eval_lengths"][1:]:
            factor = length / cfg["context"]
            pi = Decoder(dataclasses.replace(model.config, encoding=f"linear:factor={factor:g}"))
            pi.load_state_dict(model.state_dict())
            r = run_perplexity(
                pi.eval(),
                PerplexityConfig((length,), n_tokens=cfg["eval_tokens"]),
                out / f"ppl-pi-{length}",
                spec=f"linear:factor={factor:g}",
                **common,
            )
            row["pi_bpb"][length] = r["results"][0]["bits_per_byte"]
    path.write_text(json.dumps(row, indent=2))
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


def mean_std(values: list[float]) -> tuple[float, float]:
    m = sum(values) / len(values)
    s = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0
    return m, s


def aggregate(cfg: dict, rows: list[dict]) -> dict:
    columns = {"sinusoidal": [], "rope": [], "rope + PI": []}
    for row in rows:
        columns[row["encoding"]].append(row["bpb"])
        if "pi_bpb" in row:
            columns["rope + PI"].append(row["pi_bpb"])
    table = {}
    for name, runs in columns.items():
        table[name] = {}
        for length in cfg["eval_lengths"]:
            vals = [float(r[str(length)] if str(length) in r else r[length]) for r in runs]
            m, s = mean_std(vals)
            table[name][str(length)] = {"mean": m, "std": s, "values": vals}
    summaries = [
        json.loads((job_dir(e, s) / "pretrain.json").read_text())
        for e in cfg["encodings"]
        for s in cfg["seeds"]
    ]
    return {
        "config": cfg,
        "bits_per_byte": table,
        "unigram_bpb": unigram_bpb(cfg["data"]),
        "runs": [
            {
                k: s[k]
                for k in (
                    "encoding",
                    "parameters",
                    "tokens",
                    "elapsed_s",
                    "tokens_per_s",
                    "mfu",
                    "matmul_flops_per_s",
                    "final_loss",
                )
            }
            | {"seed": s["train"]["seed"]}
            for s in summaries
        ],
    }


def write_outputs(result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = result["config"]["eval_lengths"]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name, col in result["bits_per_byte"].items():
        ax.errorbar(
            lengths,
            [col[str(n)]["mean"] for n in lengths],
            yerr=[col[str(n)]["std"] for n in lengths],
            marker="o",
            capsize=3,
            label=name,
        )
    ax.axvline(result["config"]["context"], color="k", ls="--", lw=1, label="training length")
    ax.set(
        xscale="log",
        xlabel="evaluation length (bytes)",
        ylabel="validation bits per byte",
        title="Trained at 512 bytes: quality vs length (mean ± std, 3 seeds)",
    )
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.legend()
    fig.tight_layout()
    fig.savefig(HERE / "bpb_vs_length.png", dpi=120)
    (HERE / "results.json").write_text(json.dumps(result, indent=2))
    lines = [
        "| column | " + " | ".join(f"{n}" for n in lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]
    for name, col in result["bits_per_byte"].items():
        cells = [f"{col[str(n)]['mean']:.3f} ± {col[str(n)]['std']:.3f}" for n in lengths]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    (HERE / "results.md").write_text("\n".join(lines) + "\n")
    summaries = HERE / "summaries"
    summaries.mkdir(exist_ok=True)
    for run in result["runs"]:
        name = f"{run['encoding']}-s{run['seed']}.json"
        (summaries / name).write_text(json.dumps(run, indent=2))
    print("\n".join(lines))


def main() -> None:
    global RUNS, HERE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--config", type=Path, default=HERE / "config.json")
    parser.add_argument("--runs", type=Path, default=RUNS, help="training runs go here")
    parser.add_argument("--results", type=Path, default=HERE, help="committed results go here")
    args = parser.parse_args()
    RUNS, HERE = args.runs, args.results
    HERE.mkdir(parents=True, exist_ok=True)
    cfg = json.loads(args.config.read_text())
    jobs = [(e, s) for s in cfg["seeds"] for e in cfg["encodings"]]
    with ThreadPoolExecutor(args.workers) as pool:
        list(pool.map(lambda j: train_job(cfg, *j), jobs))
    # Import transformers' lazy modules once here: two threads resolving them at once race.
    from transformers import PreTrainedModel  # noqa: F401

    with ThreadPoolExecutor(args.workers) as pool:
        rows = list(pool.map(lambda j: eval_job(cfg, *j), jobs))
    write_outputs(aggregate(cfg, rows))


if __name__ == "__main__":
    main()
