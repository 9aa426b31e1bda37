"""benchmarks/results.json as a typed result: rows merged by name and device, read back as
their classes, a renamed field refused, the committed file readable."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from benchmarks.common import RESULTS, Benchmarks, Result, Row, read_results, write_results

from ropekit.results import ResultError, read_result


def test_rows_merge_by_name_and_device(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    assert read_results(path) is None
    write_results([Result("a", 1.5, 2.0, "first"), Result("b", 0.5, None, "")], "cpu", path)
    write_results([Result("a", 1.0, 2.0, "gpu")], "cuda", path)
    write_results([Result("a", 1.2, 2.0, "again"), Result("c", 3.0, 1.0, "")], "cpu", path)
    rows = read_results(path).rows
    assert [(r.name, r.device, r.note) for r in rows] == [
        ("b", "cpu", ""), ("a", "cuda", "gpu"), ("a", "cpu", "again"), ("c", "cpu", ""),
    ]  # fmt: skip
    assert all(type(r) is Row for r in rows)
    assert rows[0].target is None and rows[0].met is None
    assert rows[2].met is True and rows[3].met is False
    assert read_result(path)["kind"] == "benchmarks"


def test_a_renamed_field_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    write_results([Result("a", 1.5, 2.0, "")], "cpu", path)
    data = json.loads(path.read_text())
    data["rows"][0]["speedup"] = data["rows"][0].pop("ratio")
    path.write_text(json.dumps(data))
    with pytest.raises(ResultError, match="ratio"):
        read_results(path)
    with pytest.raises(ResultError, match="ratio"):
        write_results([Result("b", 1.0, None, "")], "cpu", path)  # nothing merged over it
    assert "speedup" in path.read_text()


def test_the_committed_rows_read() -> None:
    result = read_results(RESULTS)
    assert isinstance(result, Benchmarks) and len(result.rows) > 100
    names = [(r.name, r.device) for r in result.rows]
    assert len(names) == len(set(names))
    assert all(math.isfinite(r.ratio) and r.ratio > 0 for r in result.rows)


def test_paired_rounds_alternate_order_and_cancel_load_that_drifts_between_rounds(monkeypatch):
    """benchmarks.common.paired: each round times both back to back, every other round in
    reverse order, and the ratio is the median of the rounds' ratios, so a load that changes
    from round to round (the clock runs 1x, 2x, ... 5x as fast) cancels within each, and one
    disturbed run moves one round's ratio, where it would move the ratio of the medians."""
    from benchmarks import common

    clock, calls = [0.0], []

    def timed(name: str, cost: float):
        def run():
            calls.append(name)
            load = max(1, (len(calls) - 1) // 2)  # the warm-up and round 1 at 1x, round r at rx
            clock[0] += cost * load + (3.0 if len(calls) == 4 else 0.0)  # round 1's b disturbed

        return run

    monkeypatch.setattr(common.time, "perf_counter", lambda: clock[0])
    result = common.paired(timed("a", 2.0), timed("b", 1.0), repeats=5)
    assert calls[:2] == ["a", "b"]  # the warm-up
    assert calls[2:] == ["a", "b", "b", "a"] * 2 + ["a", "b"]  # alternating, round by round
    assert result.ratio == 2.0 and result.quartiles[1] == 2.0
    # the medians: a 2, 4, 6, 8, 10 -> 6; b 4 (disturbed), 2, 3, 4, 5 -> 4: their ratio 1.5
    assert (result.a, result.b) == (6.0, 4.0)


@pytest.mark.parametrize(
    "spec",
    ["rerope:window=16,leaky=4", "self-extend:group=4,window=16",
     "dca:chunk_size=40,local_size=8,scale=chunkllama"],
)  # fmt: skip
@pytest.mark.parametrize("length", [150, 152], ids=["a partial last block", "whole blocks"])
def test_the_decoding_benchmark_times_one_computation_two_ways(spec: str, length: int) -> None:
    """benchmarks/paged_decoding.py times two computations of one thing: the compiled pass and
    the torch step give the same output (float64, small heads, blocks of 8: every band crosses
    blocks, and one shares a block with another)."""
    import torch
    from benchmarks.paged_decoding import case

    shape = {"n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "block": 8, "base": 1e4,
             "original_length": 64}  # fmt: skip
    steps = case(spec, length, torch.float64, shape)
    torch.testing.assert_close(steps["compiled"](), steps["torch"](), rtol=1e-10, atol=1e-10)
