"""inspect's reports, without engines: ropekit's exports show no disagreement where the engines
agree, and the known engine differences are found with the change that removes them. (Each
engine's rule: tests/serve/engines/; against the real engines: ``make test-serving``.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ropekit.cli import main
from ropekit.hf import patch
from ropekit.serve.engines import transformers_rope
from ropekit.serve.exporting import export
from ropekit.serve.inspection import inspect_folder
from tests.tiny import L0, perturb, tiny_model


def _folder(spec: str, tmp_path: Path, *, learned: bool = False) -> Path:
    model = tiny_model("llama")
    encoding = patch(model, spec)
    if learned:
        perturb(encoding, scale=False)
    return export(model, None, tmp_path / spec.split(":")[0])


@pytest.mark.parametrize(
    "spec", ["yarn:factor=4", "linear:factor=4", "llama3:factor=4", "ntk:factor=4", "rope"]
)
def test_ropekit_exports_have_no_disagreement(spec: str, tmp_path: Path) -> None:
    report = inspect_folder(_folder(spec, tmp_path))
    assert report["disagreements"] == [], report["disagreements"]
    assert report["target_length"] == (L0 if spec == "rope" else 4 * L0)
    for row in report["views"].values():
        assert row["vllm"]["max_length"] >= report["target_length"]


def test_a_learned_shared_schedule_has_no_disagreement(tmp_path: Path) -> None:
    spec = "adarope:init=yarn,factor=2,share_heads=true,share_layers=true,scale=false"
    report = inspect_folder(_folder(spec, tmp_path, learned=True))
    assert report["disagreements"] == [], report["disagreements"]


def test_dynamic_export_disagrees_beyond_the_window_only(tmp_path: Path) -> None:
    report = inspect_folder(_folder("dynamic-ntk:factor=4", tmp_path))
    vllm = [d for d in report["disagreements"] if d["engine"] == "vllm"]
    assert {d["length"] for d in vllm} == {4 * L0}, vllm  # plain RoPE inside L0 agrees
    assert "fixed base" in vllm[0]["fix"]
    llama = [d for d in report["disagreements"] if d["engine"] == "llama.cpp"]
    assert llama and "length-following" in llama[0]["what"]


def _edit(folder: Path, change) -> Path:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))
    (folder / "ropekit_export.json").unlink()
    return folder


def test_a_yarn_folder_at_the_original_length_is_refused_by_vllm_with_the_fix(tmp_path) -> None:
    """The bug the issue reports: max_position_embeddings left at L0."""
    folder = _edit(
        _folder("yarn:factor=4", tmp_path), lambda c: c.update(max_position_embeddings=L0)
    )
    report = inspect_folder(folder)
    assert report["target_length"] == 4 * L0
    fixes = [d["fix"] for d in report["disagreements"] if d["engine"] == "vllm"]
    assert any(f"max_position_embeddings = {4 * L0}" in f for f in fixes), report["disagreements"]


def test_longrope_without_mscales_disagrees_on_the_attention_factor(tmp_path: Path) -> None:
    spec = "adarope:init=yarn,factor=2,share_heads=true,share_layers=true,scale=false"
    folder = _folder(spec, tmp_path, learned=True)

    def drop(config):
        del config["rope_parameters"]["short_mscale"], config["rope_parameters"]["long_mscale"]

    report = inspect_folder(_edit(folder, drop))
    fixes = [d["fix"] for d in report["disagreements"] if d["engine"] == "vllm"]
    assert fixes and all("short_mscale = long_mscale" in f for f in fixes), report["disagreements"]


def test_longrope_with_two_factor_sets_names_one_fix_for_both_engines(tmp_path: Path) -> None:
    """Searched factors (short = 1 inside the window, long beyond it, as `ropekit search`
    writes): vLLM takes the long ones at every length from max_model_len and llama.cpp has one
    rope_freqs tensor, so both disagree inside the window and both fixes are short := long."""
    long = ",".join(["1"] * 2 + ["1.5"] * 2 + ["4"] * 4)
    spec = f"longrope:short_factor=[1],long_factor=[{long}],factor=4"
    report = inspect_folder(_folder(spec, tmp_path))
    inside = [d for d in report["disagreements"] if d["length"] <= L0]
    assert {d["engine"] for d in inside} == {"vllm", "llama.cpp"}, report["disagreements"]
    assert all("short_factor = long_factor" in d["fix"] for d in inside), inside
    beyond = [d for d in report["disagreements"] if d["length"] > L0 and d["engine"] == "vllm"]
    assert beyond == [], beyond  # beyond the window vLLM and transformers both take the long


def test_inspect_command_prints_engines_and_writes_json(tmp_path: Path, capsys) -> None:
    folder = _folder("yarn:factor=4", tmp_path)
    assert main(["inspect", str(folder), "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "vllm" in out and "llama.cpp" in out and "no disagreements" in out
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["kind"] == "inspect" and written["report"]["target_length"] == 4 * L0
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    # another folder's report, or a file inspect did not write, is not replaced
    other = _folder("linear:factor=2", tmp_path / "other")
    assert main(["inspect", str(other), "--json", str(tmp_path / "r.json")]) == 2
    (tmp_path / "notes.json").write_text("{}")
    assert main(["inspect", str(folder), "--json", str(tmp_path / "notes.json")]) == 2
    assert (tmp_path / "notes.json").read_text() == "{}"
    assert json.loads((tmp_path / "r.json").read_text()) == written
    assert main(["inspect", str(other), "--json", str(tmp_path / "r.json"), "--overwrite"]) == 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c["rope_parameters"].update(rope_theta=-1), "rope_theta=-1 is not allowed"),
        (lambda c: c["rope_parameters"].update(factor=0), "factor=0 is not allowed"),
        (lambda c: c["rope_parameters"].update(rope_type="warp"), "rope_type='warp' is not"),
        (lambda c: c.update(max_position_embeddings=-5), "max_position_embeddings=-5 is not"),
        (lambda c: c["rope_parameters"].update(beta_fast="x"), "beta_fast='x' is not allowed"),
        (lambda c: c.update(rope_parameters=[1]), "rope_parameters must be a JSON object"),
    ],
)
def test_nonsense_rope_values_are_errors_not_agreement(tmp_path, capsys, change, message):
    folder = _edit(_folder("yarn:factor=4", tmp_path), change)
    capsys.readouterr()  # the export's own output
    assert main(["inspect", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and str(folder / "config.json") in err and err.count("\n") == 0


@pytest.mark.parametrize("text", ["[]", "{not json", "\xff\xfe"])
def test_a_config_that_is_not_a_json_object_is_one_line_naming_the_file(tmp_path, capsys, text):
    folder = _folder("yarn:factor=4", tmp_path)
    (folder / "config.json").write_bytes(text.encode("latin-1"))
    capsys.readouterr()
    assert main(["inspect", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert str(folder / "config.json") in err and err.count("\n") == 0


LEARNED = "adarope:init=yarn,factor=2,share_heads=true,share_layers=true,scale=false"


@pytest.mark.parametrize(
    "spec", ["rope", "linear:factor=2", "yarn:factor=2", "llama3:factor=4", LEARNED]
)
def test_inspect_reads_a_gguf_export_and_finds_llamacpp_exact(
    spec: str, tmp_path: Path, tiny_llama
) -> None:
    from ropekit.serve.inspection import format_report

    model = tiny_llama({"rope_type": "default", "rope_theta": 5e5})  # not the default
    perturb(patch(model, spec))  # the learned one: rope_freqs and an attention factor != 1
    out = export(model, None, tmp_path / "g", format="gguf")
    params = json.loads((out / "ropekit_export.json").read_text())["rope_parameters"]
    for where in (out, out / "model.gguf"):  # the folder or the file itself
        report = inspect_folder(where)
        assert report["format"] == "gguf" and report["reference"] == "transformers"
        assert report["disagreements"] == [], report["disagreements"]
        for n, row in report["views"].items():
            assert set(row) == {"transformers", "llama.cpp"}
            want = transformers_rope({**model.config.to_dict(), "rope_parameters": params}, n)
            torch.testing.assert_close(
                torch.tensor(row["llama.cpp"]["inv_freq"], dtype=torch.float64), want.inv_freq,
                rtol=1e-6, atol=0,
            )  # fmt: skip
        assert "GGUF was written from" in "\n".join(format_report(report))


def test_inspect_reads_what_the_gguf_file_says(tmp_path: Path, tiny_llama) -> None:
    """llama.cpp's row comes from the file's keys: without the record nothing is compared; a
    record that says another schedule than the file is a disagreement."""
    model = tiny_llama()
    patch(model, "yarn:factor=2")
    out = export(model, None, tmp_path / "g", format="gguf")
    record_file = out / "ropekit_export.json"
    record = json.loads(record_file.read_text())
    record["rope_parameters"]["factor"] = 4.0
    record_file.write_text(json.dumps(record))
    found = {d["what"].split(" by ")[0] for d in inspect_folder(out)["disagreements"]}
    assert found == {"frequencies differ", "attention factor 1.069315 vs transformers' 1.138629"}
    record_file.unlink()
    alone = inspect_folder(out)
    assert alone["reference"] is None and alone["disagreements"] == []
    assert [set(row) for row in alone["views"].values()] == [{"llama.cpp"}] * 2


def test_inspect_refuses_what_is_no_export(tmp_path: Path, capsys) -> None:
    (tmp_path / "model.gguf").write_bytes(b"GGUF but not really")
    (tmp_path / "empty").mkdir()
    for where, message in ((tmp_path, "is not a GGUF file"), (tmp_path / "empty", "nor a GGUF")):
        assert main(["inspect", str(where)]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


def test_inspect_says_transformers_dynamic_ntk_is_not_exact_through_its_cache(
    tmp_path, tiny_llama
) -> None:
    model = tiny_llama()
    patch(model, "dynamic-ntk:factor=2")
    report = inspect_folder(export(model, None, tmp_path / "d"))
    (mine,) = [d for d in report["disagreements"] if d["engine"] == "transformers"]
    assert "KV cache" in mine["what"] and "yarn" in mine["fix"]


def test_inspect_says_llamacpp_serves_a_self_extend_export_through_the_recipe(
    tmp_path, tiny_llama
) -> None:
    """A self-extend:mode=llama.cpp GGUF holds its base schedule; the record and inspect name
    the recipe (ropekit.serve.llamacpp_self_extend) with the group and window, and the target
    is Self-Extend's reach: the longest prompt whose distances stay below L0."""
    from ropekit.serve.inspection import format_report

    model = tiny_llama()
    patch(model, "self-extend:group=4,window=8,mode=llama.cpp")
    out = export(model, None, tmp_path / "g", format="gguf")
    record = json.loads((out / "ropekit_export.json").read_text())
    assert record["rope_parameters"]["rope_type"] == "default"
    recipe = record["serve_with"]
    assert recipe["recipe"] == "ropekit.serve.llamacpp_self_extend"
    assert (recipe["group"], recipe["window"], recipe["original_length"]) == (4, 8, L0)
    # blocks b with b W / G + W - 1 < L0 = 32: b <= 12, so 13 blocks of 8 tokens
    assert record["target_length"] == 13 * 8
    report = inspect_folder(out)
    assert report["disagreements"] == [] and report["original_length"] == L0
    text = "\n".join(format_report(report))
    assert "--group 4 --window 8" in text and "pos_div" in text
    assert "llama.cpp serves self-extend:" in text
    assert "README.md" in {p.name for p in out.iterdir()}
    assert "llamacpp_self_extend" in (out / "README.md").read_text()


# ----------------------------------------------------------------------------- families
def _family_folder(family: str, spec: str, tmp_path: Path) -> Path:
    from tests.tiny import family_model

    model = family_model(family)
    patch(model, spec)
    return export(model, None, tmp_path / family)


def test_per_layer_type_rope_is_inspected_type_by_type(tmp_path: Path) -> None:
    """Gemma 3: yarn on the global layers, the local layers keep their base; vLLM's model file
    reads each type's dict (gemma3.py), so it agrees type by type; llama.cpp's GGUF of this
    family is its own converter's, named, not guessed."""
    report = inspect_folder(_family_folder("gemma3_text", "yarn:factor=4", tmp_path))
    sections = report["layer_types"]
    assert sections["full_attention"]["rope_parameters"]["rope_type"] == "yarn"
    assert sections["sliding_attention"]["rope_parameters"] == {
        "rope_type": "default", "rope_theta": 10000.0
    }  # fmt: skip
    for kind, section in sections.items():
        n = section["target_length"]
        theirs = section["views"][n]["transformers"]["inv_freq"]
        assert section["views"][n]["vllm"]["inv_freq"] == theirs, kind
    assert sections["sliding_attention"]["views"][n]["transformers"]["inv_freq"][
        1
    ] == pytest.approx(10000.0 ** (-2 / 16))
    engines = {(d["engine"], d["layer_type"]) for d in report["disagreements"]}
    assert engines == {("llama.cpp", "full_attention"), ("llama.cpp", "sliding_attention")}
    assert all("convert_hf_to_gguf.py" in d["fix"] for d in report["disagreements"])


def test_vllm_serving_p_rope_without_its_factor_is_found(tmp_path: Path) -> None:
    """Gemma 4's global layers: vLLM's Gemma4RotaryEmbedding reads no factor, so a scaled
    p-RoPE is served unscaled there; its accepted length takes the factor (every type's
    rope_parameters, iter_rope_parameters), the local layers' included."""
    report = inspect_folder(_family_folder("gemma4_text", "proportional:factor=2", tmp_path))
    full, local = (
        report["layer_types"]["full_attention"],
        report["layer_types"]["sliding_attention"],
    )
    found = [d for d in report["disagreements"] if d["engine"] == "vllm"]
    assert {d["layer_type"] for d in found} == {"full_attention"}
    assert all("frequencies differ" in d["what"] for d in found)
    view = full["views"][full["target_length"]]
    assert view["vllm"]["inv_freq"][0] == 2 * view["transformers"]["inv_freq"][0]
    assert view["vllm"]["inv_freq"][-1] == view["transformers"]["inv_freq"][-1] == 0.0  # zeroed
    assert local["views"][local["target_length"]]["vllm"]["max_length"] == 2 * L0


@pytest.mark.parametrize(
    ("family", "source"),
    [("smollm3", "_TRANSFORMERS_SUPPORTED_MODELS"), ("helium", "registry has no model")],
)
def test_how_stock_vllm_serves_a_family_is_said(family: str, source: str, tmp_path) -> None:
    report = inspect_folder(_family_folder(family, "linear:factor=2", tmp_path))
    view = report["views"][report["target_length"]]["vllm"]
    assert source in (view["error"] or view["source"])
    vllm = [d for d in report["disagreements"] if d["engine"] == "vllm"]
    assert bool(vllm) == (family == "helium")
