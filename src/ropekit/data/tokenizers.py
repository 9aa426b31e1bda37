"""Tokenizers behind one small protocol.

Holds:
- `Tokenizer`: the protocol every consumer uses (`encode`, `decode`, `encode_with_bytes`,
  `name`, `vocab_size`, `separator`).
- `ByteTokenizer`: the default; a token is one UTF-8 byte (vocab 256), so bits per byte is
  exactly the per-token loss in bits.
- `HFTokenizer`: any Hugging Face fast tokenizer, read from local files only.
- `load_tokenizer(name_or_path)`: "bytes", a local tokenizer folder, or a `.gguf` file.

`encode_with_bytes` returns, beside the ids, how many UTF-8 bytes of the text each token
covers (summing to the text's byte length). Evaluations use it to turn a window's NLL into
bits per byte for any tokenizer.
"""

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Tokenizer(Protocol):
    name: str  # "bytes", or the path the tokenizer was read from
    vocab_size: int  # ids are in [0, vocab_size)
    # What goes between packed documents: text to encode, or one special token id (EOS).
    separator: str | int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_with_bytes(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """ids (n,) int64 and the UTF-8 bytes each token covers (n,) int64."""
        ...


class ByteTokenizer:
    """One token per UTF-8 byte: no vocabulary to train, nothing to download."""

    name = "bytes"
    vocab_size = 256
    separator = "\n\n"  # a blank line between documents: ordinary bytes, no special id

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # A window may cut a multi-byte character: replace it rather than fail.
        return bytes(ids).decode("utf-8", errors="replace")

    def encode_with_bytes(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        return ids, np.ones_like(ids)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def _utf8_lengths(text: str) -> np.ndarray:
    """UTF-8 byte length of each character of `text` (len(text),)."""
    codepoints = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    return 1 + (codepoints >= 0x80) + (codepoints >= 0x800) + (codepoints >= 0x10000)


class HFTokenizer:
    """A Hugging Face fast tokenizer seen through the `Tokenizer` protocol.

    Text is encoded without special tokens (no BOS); documents are separated by the EOS token
    when the tokenizer has one, else by a blank line.
    """

    def __init__(self, tokenizer: Any, name: str | None = None):
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(
                f"tokenizer {name or tokenizer!r} is not a fast (Rust) tokenizer; allowed: fast "
                "tokenizers, whose character offsets let ropekit count bytes per token"
            )
        self.tokenizer = tokenizer
        self.name = name or str(tokenizer.name_or_path)
        self.vocab_size = len(tokenizer)  # includes added tokens, as the embedding must
        eos = tokenizer.eos_token_id
        self.separator: str | int = "\n\n" if eos is None else int(eos)

    def encode(self, text: str) -> list[int]:
        # verbose=False: a whole book is longer than model_max_length, which is expected here.
        return self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(
            list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def encode_with_bytes(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        encoded = self.tokenizer(
            text, add_special_tokens=False, return_offsets_mapping=True, verbose=False
        )
        ids = np.asarray(encoded["input_ids"], dtype=np.int64)
        if len(ids) == 0:
            return ids, np.zeros(0, dtype=np.int64)
        # Character offsets -> byte offsets. Each token is charged the bytes from the end of
        # the previous token to its own end, so bytes a tokenizer skips (stripped spaces) and
        # characters split over several byte tokens are counted exactly once.
        ends = np.maximum.accumulate(np.asarray(encoded["offset_mapping"], dtype=np.int64)[:, 1])
        ends[-1] = len(text)
        char_to_byte = np.concatenate([[0], np.cumsum(_utf8_lengths(text))])
        byte_ends = char_to_byte[ends]
        return ids, np.diff(byte_ends, prepend=0)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r})"


def load_tokenizer(name_or_path: str | os.PathLike[str] = "bytes") -> Tokenizer:
    """ "bytes" -> `ByteTokenizer`; a local folder (or a cached Hub id) -> `HFTokenizer` via
    `AutoTokenizer(local_files_only=True)`; a `.gguf` file -> the tokenizer stored in it.
    Nothing is ever downloaded."""
    if isinstance(name_or_path, str) and name_or_path == "bytes":
        return ByteTokenizer()
    from transformers import AutoTokenizer  # imported here: slow, and unneeded for bytes

    path = Path(name_or_path)
    try:
        if path.suffix == ".gguf" and path.is_file():
            hf = AutoTokenizer.from_pretrained(
                str(path.parent), gguf_file=path.name, local_files_only=True
            )
        else:
            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"tokenizer {os.fspath(name_or_path)!r} could not be loaded ({e}); allowed: "
            "'bytes', a local folder with tokenizer files (tokenizer.json, ...), a .gguf file, "
            "or a Hub id already in the local cache (ropekit never downloads)"
        ) from None
    return HFTokenizer(hf, name=os.fspath(name_or_path))


def tokenizer_identity(tokenizer: Tokenizer | None) -> dict[str, Any] | None:
    """What a result's provenance records about a tokenizer: bytes, or a digest of the whole
    Hugging Face tokenizer (vocabulary, merges, normalizer...), not the folder it came from."""
    if tokenizer is None:
        return None
    if isinstance(tokenizer, ByteTokenizer):
        return {"name": "bytes"}
    if isinstance(tokenizer, HFTokenizer):
        spec = tokenizer.tokenizer.backend_tokenizer.to_str()
        return {
            "vocab_size": tokenizer.vocab_size,
            "sha256": hashlib.sha256(spec.encode("utf-8")).hexdigest(),
        }
    return {"name": tokenizer.name, "vocab_size": tokenizer.vocab_size}
