"""The ``ropekit`` model of lm-evaluation-harness: every lm-eval task on a ropekit-extended
model.

    ropekit-lm-eval --model ropekit --model_args pretrained=smollm2-135m,method=yarn:factor=2 \\
        --tasks TASK [--include_path DIR] ...
    ropekit-lm-eval --model ropekit --model_args pretrained=M,adapter=runs/x/adapter ...

``RopekitLM`` is lm-eval's own Hugging Face model (``lm_eval.models.huggingface.HFLM``, so
log-likelihood, rolling perplexity and generation behave exactly as for ``--model hf``) built
on a model ropekit opened and patched: ``pretrained`` is what ``ropekit.hf.load_model`` opens
(a folder or an installed name, offline), ``method`` a spec to patch with, or ``adapter`` a
folder ``ropekit.backbone.load_adapter`` loads; ``max_length`` defaults to the encoding's target
length (factor x L0, ``ropekit.serve.exporting.target_length``), so lm-eval does not truncate an
extended model's inputs to the original window.

Why a console script: lm-eval 0.4.13 finds models only in its fixed table
(``lm_eval/models/__init__.py: MODEL_MAPPING``) or in modules already imported that call
``register_model``; it reads no entry points for models. ``ropekit-lm-eval`` is lm-eval's CLI
(``lm_eval.__main__.cli_evaluate``) run after this module registers ``ropekit``; in Python,
``import ropekit.serve.lm_eval_model`` before ``lm_eval.simple_evaluate(model="ropekit", ...)``.

Holds: RopekitLM, main.
"""

from __future__ import annotations

from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from ropekit.backbone import load_adapter
from ropekit.hf import load_model, load_tokenizer, patch

from .exporting import target_length

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@register_model("ropekit")
class RopekitLM(HFLM):
    """lm-eval's HFLM over a ropekit-patched Hugging Face model."""

    def __init__(
        self,
        pretrained: str,
        method: str | None = None,
        adapter: str | None = None,
        dtype: str = "float32",
        max_length: int | None = None,
        trust_remote_code: bool = False,
        **kwargs: Any,
    ) -> None:
        if method and adapter:
            raise ValueError("give method=SPEC or adapter=FOLDER, not both")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r} is not allowed; allowed: {', '.join(_DTYPES)}")
        model = load_model(pretrained, dtype=_DTYPES[dtype], trust_remote_code=trust_remote_code)
        encoding = None
        if adapter:
            encoding = load_adapter(model, adapter)
        elif method:
            encoding = patch(model, method)
        if max_length is None:
            max_length = (
                target_length(encoding, model.config)
                if encoding is not None
                else int(model.config.max_position_embeddings)
            )
        tokenizer = load_tokenizer(pretrained, trust_remote_code=trust_remote_code)
        self.ropekit_spec = encoding.spec if encoding is not None else None
        super().__init__(
            pretrained=model, tokenizer=tokenizer, max_length=int(max_length), **kwargs
        )


def main() -> None:
    """``ropekit-lm-eval``: lm-eval's command line with the ``ropekit`` model registered."""
    import os

    from lm_eval.__main__ import cli_evaluate

    # Offline, as the ropekit CLI: models and data come from installed packages.
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(var, "1")
    cli_evaluate()
