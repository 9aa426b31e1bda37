"""The synthetic retrieval mixture: records woven into real text, answers and loss weights."""

import numpy as np
import pytest
import torch

from ropekit.data import (
    IGNORE_INDEX,
    ByteTokenizer,
    HFTokenizer,
    PackedDataset,
    RetrievalConfig,
    Tokenizer,
    make_train_dataset,
)

T = 256
BYTES = ByteTokenizer()
# "\nThe pass key is 48213. Remember it.\n" + "\nWhat is the pass key? The pass key is 48213.\n"
PASSKEY_BYTES = 37 + 46


def _dataset(tokenizer: Tokenizer = BYTES, seed: int = 0, **config) -> PackedDataset:
    retrieval = RetrievalConfig(**{"ratio": 1.0, "answer_weight": 5.0, **config})
    return make_train_dataset("essays", tokenizer, T, seed=seed, retrieval=retrieval)


def _check_sample(ds: PackedDataset, k: int, tokenizer: Tokenizer) -> None:
    sample, info = ds[k], ds.retrieval_info(k)
    assert info is not None
    ids, labels, weight = sample["input_ids"], sample["labels"], sample["loss_weight"]
    answer_positions = torch.zeros(T, dtype=torch.bool)
    for (start, stop), answer, source in zip(
        info.answer_spans, info.answers, info.sources, strict=True
    ):
        # The answer is exactly where recorded, and the record it comes from holds it.
        assert tokenizer.decode(labels[start:stop].tolist()) == " " + answer
        record_start, record_stop = info.record_spans[source]
        record = tokenizer.decode(ids[record_start:record_stop].tolist())
        expected = "The pass key is" if info.kind == "passkey" else "The value of key"
        assert record.startswith("\n" + expected)
        assert f" {answer}." in record
        assert record_stop <= start  # the record comes before its query
        answer_positions[start:stop] = True
    # The weights mark exactly the answers; weight 0 exactly where the label is ignored.
    assert torch.equal(weight == ds.retrieval.answer_weight, answer_positions)
    assert torch.equal(weight == 0, labels == IGNORE_INDEX)
    assert torch.all((weight == 1) | (weight == 0) | answer_positions)


@pytest.mark.parametrize("kinds", [("passkey",), ("kv",)])
def test_answers_and_weights_are_where_recorded(kinds: tuple[str, ...]):
    ds = _dataset(kinds=kinds, n_facts=3, n_queries=2)
    for k in range(100):
        _check_sample(ds, k, BYTES)
        assert ds.retrieval_info(k).kind == kinds[0]


def test_subword_tokenizer_answers_are_where_recorded(hf_tokenizer: HFTokenizer):
    ds = _dataset(hf_tokenizer)
    for k in range(40):
        _check_sample(ds, k, hf_tokenizer)


def test_only_random_characters_are_ignored():
    config = {"kinds": ("kv",), "n_facts": 3, "n_queries": 2, "key_letters": 2, "value_digits": 6}
    ds = _dataset(**config)
    # Bytes of random text: each fact's " KEY" and " VALUE", and the " KEY" each query asks for.
    expected = 3 * (1 + 2 + 1 + 6) + 2 * (1 + 2)
    for k in range(20):
        assert int((ds[k]["labels"] == IGNORE_INDEX).sum()) == expected


def test_records_are_woven_into_the_natural_sample():
    woven = _dataset(seed=4, kinds=("passkey",))
    plain = make_train_dataset("essays", "bytes", T, seed=4)
    for k in range(20):
        tokens, _, info = woven.sample(k)
        keep = np.arange(len(tokens)) < info.query_start
        for start, stop in info.record_spans:
            keep[start:stop] = False
        # Outside the records and the closing query, the text is the plain sample's prefix.
        text = tokens[keep]
        assert len(text) == T + 1 - PASSKEY_BYTES
        assert text.tolist() == plain.sample(k)[0][: len(text)].tolist()


def test_record_depth_is_uniform_over_the_sample():
    ds = _dataset(kinds=("passkey",))
    starts = np.array([ds.retrieval_info(k).record_spans[0][0] for k in range(600)])
    room = T + 1 - PASSKEY_BYTES  # where a record can start
    assert starts.min() < 0.05 * room and starts.max() > 0.95 * room
    assert abs(starts.mean() / room - 0.5) < 0.05


def test_records_kept_back_start_uniformly_over_what_is_left_and_too_far_is_refused():
    """``weave(at_least_back=b)``: every record is followed by at least b filler tokens before
    the query (what search's needle documents ask: needles past the trained length)."""
    from ropekit.data.retrieval import draw_records, weave

    filler = np.asarray(make_train_dataset("essays", "bytes", T, seed=0).sample(0)[0])
    config = RetrievalConfig(ratio=1.0, kinds=("passkey",))
    room = len(filler) - PASSKEY_BYTES  # filler tokens the sample keeps
    starts = []
    for k in range(400):
        rng = np.random.default_rng(k)
        _, _, info = weave(filler, draw_records(rng, config), BYTES, rng, at_least_back=150)
        ((start, stop),) = info.record_spans
        assert info.query_start - stop >= 150
        starts.append(start)
    assert min(starts) == 0 and max(starts) == room - 150  # both ends of what is left reached
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match=rf"at_least_back={room + 1} .* allowed: 0 to {room}"):
        weave(filler, draw_records(rng, config), BYTES, rng, at_least_back=room + 1)


def test_ratio_is_respected_over_many_samples():
    ds = _dataset(ratio=0.3)
    carried = [ds.retrieval_info(k) is not None for k in range(3000)]
    assert abs(np.mean(carried) - 0.3) < 0.03
    plain = next(k for k, c in enumerate(carried) if not c)
    assert torch.equal(ds[plain]["loss_weight"], torch.ones(T))


def test_same_seed_same_samples_other_seed_other_records():
    a, b, c = _dataset(seed=1), _dataset(seed=1), _dataset(seed=2)
    for k in range(10):
        assert a.retrieval_info(k) == b.retrieval_info(k)
        for key in ("input_ids", "labels", "loss_weight"):
            assert torch.equal(a[k][key], b[k][key])
    assert [a.retrieval_info(k).answers for k in range(10)] != [
        c.retrieval_info(k).answers for k in range(10)
    ]


def test_a_chunk_seen_again_gets_fresh_records():
    retrieval = RetrievalConfig(ratio=1.0, kinds=("passkey",))
    ds = make_train_dataset("essays", "bytes", T, shuffle=False, retrieval=retrieval)
    # Unshuffled, sample k and sample k + len(ds) are the same chunk in two epochs.
    answers = [
        (ds.retrieval_info(k).answers, ds.retrieval_info(k + len(ds)).answers) for k in range(5)
    ]
    assert all(first != second for first, second in answers)


def test_context_too_short_for_the_records():
    with pytest.raises(ValueError, match=r"context=64 is too short.*n_facts"):
        make_train_dataset(
            "essays", "bytes", 64, retrieval=RetrievalConfig(ratio=0.5, kinds=["kv"])
        )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("ratio", 1.5),
        ("kinds", ("needle",)),
        ("n_facts", 0),
        ("n_queries", 9),
        ("answer_weight", -1.0),
        ("passkey_digits", 0),
    ],
)
def test_bad_config_names_the_field(field: str, value: object):
    with pytest.raises(ValueError, match=f"{field}="):
        RetrievalConfig(**{field: value})
