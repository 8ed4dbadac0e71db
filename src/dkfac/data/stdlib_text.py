"""Character-level text that every machine has: the Python standard library's own sources.

A fixed list of standard-library modules (:data:`STDLIB_TEXT_MODULES`) is read from the
running interpreter's installation (nothing is downloaded). Each file's text is split by
position: its first ``1 - valid_fraction`` goes to training, the rest to validation, so both
splits see every file's style and neither sees the other's characters (``max_chars`` keeps
the first characters of each split, so only the first files' text). Characters are bytes
of the UTF-8 text; bytes outside ASCII (rare in these files) map to one id,
:data:`OTHER_BYTE`. An example is a window of ``seq_len + 1`` characters: the first
``seq_len`` are the input, the last ``seq_len`` the targets (the next character at every
position). Windows do not overlap.

The text depends on the Python version (the sources change between releases): results
record ``sys.version``.
"""

from __future__ import annotations

import logging
import sys
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

logger = logging.getLogger(__name__)

__all__ = ["OTHER_BYTE", "STDLIB_TEXT_MODULES", "VOCAB_SIZE", "load_stdlib_text", "stdlib_files"]

#: Modules whose source files make the text, in this order (each present since Python 3.8).
STDLIB_TEXT_MODULES: tuple[str, ...] = (
    "argparse",
    "ast",
    "bisect",
    "calendar",
    "codecs",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "difflib",
    "enum",
    "fnmatch",
    "fractions",
    "functools",
    "glob",
    "heapq",
    "inspect",
    "json.decoder",
    "json.encoder",
    "locale",
    "numbers",
    "operator",
    "pprint",
    "queue",
    "random",
    "sched",
    "shlex",
    "shutil",
    "statistics",
    "tempfile",
    "textwrap",
    "threading",
    "tokenize",
    "typing",
    "uuid",
    "weakref",
)
#: Token ids: the 128 ASCII bytes; every other byte is :data:`OTHER_BYTE`.
VOCAB_SIZE = 128
#: The id of a byte outside ASCII (NUL, which source files do not contain).
OTHER_BYTE = 0


def stdlib_files(modules: tuple[str, ...] = STDLIB_TEXT_MODULES) -> list[Path]:
    """The source file of each module in this interpreter's standard library folder.

    Found by path (``json.decoder`` is ``json/decoder.py``, a package its ``__init__.py``),
    not by import: modules the interpreter freezes (``codecs``) have no ``__file__``.

    Raises:
        FileNotFoundError: a module has no source file there (a stripped installation).
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for name in modules:
        base = stdlib.joinpath(*name.split("."))
        found = [p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()]
        if not found:
            raise FileNotFoundError(
                f"the standard library's source of {name!r} is not in {stdlib} (looked for "
                f"{base}.py and {base}/__init__.py): the pysource dataset needs the Python "
                "sources installed"
            )
        files.append(found[0])
    return files


def _encode(text: bytes) -> torch.Tensor:
    ids = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.long)
    return torch.where(ids < VOCAB_SIZE, ids, OTHER_BYTE)


def _windows(ids: torch.Tensor, seq_len: int) -> TensorDataset:
    count = (ids.numel() - 1) // seq_len
    if count < 1:
        raise ValueError(f"the text ({ids.numel()} characters) is shorter than one window")
    inputs = ids[: count * seq_len].view(count, seq_len)
    targets = ids[1 : count * seq_len + 1].view(count, seq_len)
    return TensorDataset(inputs.clone(), targets.clone())


def load_stdlib_text(
    seq_len: int = 64, valid_fraction: float = 0.1, max_chars: int | None = None
) -> tuple[TensorDataset, TensorDataset]:
    """Training and validation windows of the standard library's text (see the module).

    Args:
        seq_len: characters per example (inputs and targets each).
        valid_fraction: share of each file's text, at its end, kept for validation.
        max_chars: keep at most this many characters of training text (the first ones) and
            ``valid_fraction / (1 - valid_fraction)`` of that of validation text; ``None``:
            all (about 1.3 MB of text on Python 3.11).

    Returns:
        ``(train, valid)``: datasets of ``(inputs, targets)``, both ``(seq_len,)`` longs.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r} is not allowed: expected an integer >= 1")
    if not 0.0 < valid_fraction < 1.0:
        raise ValueError(f"valid_fraction={valid_fraction!r}: expected a number in (0, 1)")
    train_parts, valid_parts = [], []
    for path in stdlib_files():
        ids = _encode(path.read_bytes())
        cut = round(ids.numel() * (1.0 - valid_fraction))
        train_parts.append(ids[:cut])
        valid_parts.append(ids[cut:])
    train_ids, valid_ids = torch.cat(train_parts), torch.cat(valid_parts)
    if max_chars is not None:
        if max_chars < seq_len + 1:
            raise ValueError(f"max_chars={max_chars!r}: expected at least seq_len + 1")
        train_ids = train_ids[:max_chars]
        valid_chars = max(seq_len + 1, round(max_chars * valid_fraction / (1 - valid_fraction)))
        valid_ids = valid_ids[:valid_chars]
    logger.debug(
        "standard-library text (Python %s): %d training and %d validation characters",
        sys.version.split()[0],
        train_ids.numel(),
        valid_ids.numel(),
    )
    return _windows(train_ids, seq_len), _windows(valid_ids, seq_len)
