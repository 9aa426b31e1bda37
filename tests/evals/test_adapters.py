"""The model adapters: scoring against the models' own losses, chunking, batched greedy decoding
with left padding or length groups against unbatched decoding and the models' own generate."""

from __future__ import annotations

import pytest
import torch

from ropekit.evals import as_language_model, newline_ids

from .models import ConstantLM, SuffixCopyLM, tiny_decoder, tiny_llama

# float32 logits of different (but equivalent) shapes: reductions may reorder.
ATOL = 1e-5


def _sensitive_llama(attn: str = "sdpa"):
    """A tiny Llama whose output depends on its input (default init is nearly constant)."""
    model = tiny_llama(attn=attn)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    return model


@pytest.fixture(params=["hf-sdpa", "hf-eager", "decoder"])
def adapted(request, byte_tok):
    if request.param == "decoder":
        return as_language_model(tiny_decoder(), byte_tok)
    return as_language_model(_sensitive_llama(request.param.removeprefix("hf-")), byte_tok)


def test_token_nll_is_the_models_own_cross_entropy(byte_tok):
    model = _sensitive_llama()
    lm = as_language_model(model, byte_tok)
    ids = torch.randint(0, 256, (3, 41), generator=torch.Generator().manual_seed(0))
    nll = lm.token_nll(ids)
    assert nll.shape == (3, 40) and nll.dtype == torch.float32
    with torch.no_grad():
        loss = model(ids, labels=ids).loss  # HF shifts the labels itself
    assert nll.mean().item() == pytest.approx(loss.item(), abs=ATOL)


@pytest.mark.parametrize("chunk", [4, 16])
def test_chunked_scoring_through_the_cache_equals_one_forward(adapted, chunk):
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
    adapted.chunk_size = None
    full = adapted.token_nll(ids)
    adapted.chunk_size = chunk
    chunked = adapted.token_nll(ids)
    torch.testing.assert_close(chunked, full, atol=ATOL, rtol=0)


def _prompts():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (19, 7, 12, 19)]


@pytest.mark.parametrize("chunk", [None, 5])
def test_batched_greedy_equals_unbatched(adapted, chunk):
    adapted.chunk_size = chunk
    prompts = _prompts()
    batched = adapted.greedy(prompts, 10)
    single = [adapted.greedy([p], 10)[0] for p in prompts]
    assert batched == single
    assert all(len(out) == 10 for out in batched)
    assert len({tuple(out) for out in batched}) > 1  # the model does depend on its input


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_hf_greedy_with_left_padding_equals_hf_generate(byte_tok, attn):
    model = _sensitive_llama(attn)
    prompts = _prompts()
    ours = as_language_model(model, byte_tok).greedy(prompts, 8)
    theirs = [
        model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, pad_token_id=0)[
            0, len(p) :
        ].tolist()
        for p in prompts
    ]
    assert ours == theirs


def test_decoder_greedy_equals_decoder_generate(byte_tok):
    model = tiny_decoder()
    prompts = _prompts()
    ours = as_language_model(model, byte_tok).greedy(prompts, 8)
    theirs = [model.generate(torch.tensor([p]), 8)[0].tolist() for p in prompts]
    assert ours == theirs


def test_greedy_ends_each_row_before_its_first_stop_token(byte_tok):
    lm = as_language_model(SuffixCopyLM(), byte_tok)
    # The copy model continues each prompt with the text that followed its suffix before.
    prompts = [list(b"ab1\nxy2\nab"), list(b"ab1\nxy2\nxy"), list(b"ab12\n=ab")]
    out = lm.greedy(prompts, 6, stop={ord("\n")})
    assert [bytes(o) for o in out] == [b"1", b"2", b"12"]
    assert [bytes(o) for o in lm.greedy(prompts, 2)] == [b"1\n", b"2\n", b"12"]
    assert lm.greedy(prompts, 0) == [[], [], []]
    with pytest.raises(ValueError, match="max_new_tokens"):
        lm.greedy(prompts, -1)


def test_newline_ids(byte_tok, bpe_tok):
    assert newline_ids(byte_tok) == {10}
    ids = newline_ids(bpe_tok)
    assert bpe_tok.encode("\n")[0] in ids
    assert all("\n" in bpe_tok.decode([i]) for i in ids)
    assert not any("\n" in bpe_tok.decode([i]) for i in range(bpe_tok.vocab_size) if i not in ids)


def test_as_language_model_picks_the_backbone_by_class(byte_tok):
    assert as_language_model(tiny_llama(), byte_tok).backbone.kind == "hf"
    assert as_language_model(tiny_decoder()).backbone.kind == "decoder"  # bytes by default
    lm = as_language_model(ConstantLM(), "bytes")
    assert lm.backbone.kind == "decoder" and as_language_model(lm) is lm
    with pytest.raises(ValueError, match="tokenizer=None"):
        as_language_model(tiny_llama())
    with pytest.raises(ValueError, match="model="):
        as_language_model(object())
    description = as_language_model(tiny_decoder()).describe()
    assert description["class"] == "Decoder" and description["config"]["d_model"] == 32
