"""Atomic writes (ropekit.utils): a failure leaves the old file and no temp file, OS errors are
one line, and no write follows a symbolic link. And the warning for a precision this CPU only
emulates: said once, where it is true."""

from __future__ import annotations

import errno
import os
import warnings

import pytest
import torch

from ropekit import utils
from ropekit.backbone import as_backbone
from ropekit.outdir import OutputError, lock_out_dir
from ropekit.utils import atomic_write_bytes, atomic_write_text, emulated_precision

from .model.tiny import tiny_model


def _disk_full_after(monkeypatch, allowed: int) -> None:
    """Every write past the first `allowed` bytes of this test fails with ENOSPC (injected:
    no disk here is full and none can be made so without root mounts)."""
    real_write = os.write
    written = 0

    def write(fd, data):
        nonlocal written
        room = allowed - written
        if room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written += min(room, len(data))
        return real_write(fd, bytes(data[:room]))

    monkeypatch.setattr(os, "write", write)


@pytest.mark.parametrize("allowed", [0, 10])  # nothing written, or half a file
def test_a_full_disk_leaves_the_previous_file_and_no_temp_file(tmp_path, monkeypatch, allowed):
    path = tmp_path / "ppl.json"
    path.write_text('{"old": true}')
    _disk_full_after(monkeypatch, allowed)
    with pytest.raises(OutputError) as caught:
        atomic_write_text(path, '{"new": true, "padding": "' + "x" * 100_000 + '"}')
    monkeypatch.undo()
    assert str(caught.value) == f"cannot write {path}: no space left on the device"
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, OSError)
    assert path.read_text() == '{"old": true}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ppl.json"]  # no .ppl.json.*.tmp


def test_a_failing_rename_leaves_no_temp_file(tmp_path, monkeypatch):
    def refuse(src, dst):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OutputError, match="input/output error"):
        atomic_write_bytes(tmp_path / "a.bin", b"data")
    assert list(tmp_path.iterdir()) == []


def test_a_target_that_is_a_link_is_refused_and_its_target_untouched(tmp_path):
    outside = tmp_path / "elsewhere.json"
    outside.write_text("theirs")
    link = tmp_path / "run" / "summary.json"
    link.parent.mkdir()
    link.symlink_to(outside)
    with pytest.raises(OutputError, match=r"summary\.json: it is a symbolic link"):
        atomic_write_text(link, "ours")
    assert outside.read_text() == "theirs" and link.is_symlink()


def test_a_linked_folder_inside_a_locked_out_folder_is_refused(tmp_path):
    elsewhere, out = tmp_path / "elsewhere", tmp_path / "run"
    elsewhere.mkdir()
    with lock_out_dir(out):
        (out / "eval").symlink_to(elsewhere, target_is_directory=True)
        with pytest.raises(OutputError, match="eval is a symbolic link inside the output folder"):
            atomic_write_text(out / "eval" / "ppl.json", "{}")
        with pytest.raises(OutputError, match="eval is a symbolic link"):
            atomic_write_text(out / "eval" / "deeper" / "ppl.json", "{}")  # mkdir would follow
    assert list(elsewhere.iterdir()) == []
    # An explicit root does the same without a lock.
    with pytest.raises(OutputError, match="eval is a symbolic link"):
        atomic_write_text(out / "eval" / "ppl.json", "{}", root=out)


def test_a_file_where_a_folder_should_be_is_one_line(tmp_path):
    (tmp_path / "run").write_text("a file")
    for target in (tmp_path / "run" / "summary.json", tmp_path / "run" / "ppl" / "ppl.json"):
        with pytest.raises(OutputError, match=f"{tmp_path / 'run'} is a file, not a folder$"):
            atomic_write_text(target, "{}")


def test_a_long_target_name_does_not_fail_on_its_temp_name(tmp_path):
    path = tmp_path / ("r" * 250 + ".json")  # 255 bytes: allowed, but not 255 + a temp suffix
    atomic_write_text(path, "{}")
    assert path.read_text() == "{}"
    with pytest.raises(OutputError, match="a name in it is 256 bytes long"):
        atomic_write_text(tmp_path / ("r" * 251 + ".json"), "{}")


def test_written_files_get_the_usual_mode(tmp_path):
    umask = os.umask(0o022)
    try:
        atomic_write_bytes(tmp_path / "a", b"x")
    finally:
        os.umask(umask)
    assert (tmp_path / "a").stat().st_mode & 0o777 == 0o644


# ----------------------------------------------------------------------------- precision
def test_emulated_precision_is_onednn_s_own_check_on_the_cpu_only():
    assert not emulated_precision(torch.float32, "cpu")
    assert not emulated_precision(torch.float64, "cpu")
    assert (
        emulated_precision(torch.bfloat16, "cpu")
        is not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )
    assert (
        emulated_precision(torch.float16, "cpu") is not torch.ops.mkldnn._is_mkldnn_fp16_supported()
    )
    assert not emulated_precision(torch.bfloat16, "cuda")  # a GPU has its own kernels


@pytest.mark.parametrize("native", [True, False])
def test_an_emulated_precision_is_said_once_per_run(monkeypatch, native):
    monkeypatch.setattr(utils, "_NATIVE", {torch.bfloat16: lambda: native})
    monkeypatch.setattr(utils, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            utils.warn_if_emulated(torch.bfloat16, "cpu", "scoring")
        utils.warn_if_emulated(torch.float32, "cpu", "scoring")
        utils.warn_if_emulated(torch.bfloat16, "cuda", "scoring")
    messages = [str(w.message) for w in caught]
    if native:
        assert messages == []
    else:
        assert len(messages) == 1
        assert messages[0].startswith("scoring in bfloat16 on this CPU (")
        assert "float32 is faster" in messages[0] and "\n" not in messages[0]


def test_casting_a_model_to_bfloat16_warns_where_this_cpu_emulates_it(monkeypatch):
    monkeypatch.setattr(utils, "_warned", set())
    backbone = as_backbone(tiny_model("rope", n_layers=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backbone.cast(torch.bfloat16)
    said = [w for w in caught if "no native bfloat16 matmul" in str(w.message)]
    assert len(said) == int(emulated_precision(torch.bfloat16, "cpu"))
