"""Write a nanoGPT-style token file (``train.bin``: a flat array of uint16 token ids) from local text, offline.

nanoGPT's ``data/*/prepare.py`` writes its ``train.bin`` the same way (there with the GPT-2 tokenizer, or one id
per character for shakespeare_char); here each UTF-8 byte of the text is one token (a vocabulary of 256), so
nothing is downloaded. The text: the files given, else the Python standard library's own sources (a few MB).

    python examples/make_train_bin.py examples/data/train.bin [TEXT_FILE ...]
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

import numpy as np

MAX_TOKENS = 2_000_000


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    out = Path(argv[0])
    sources = [Path(a) for a in argv[1:]] or sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    data = bytearray()
    for src in sources:
        data += src.read_bytes()
        if len(data) >= MAX_TOKENS:
            break
    ids = np.frombuffer(bytes(data[:MAX_TOKENS]), dtype=np.uint8).astype(np.uint16)
    out.parent.mkdir(parents=True, exist_ok=True)
    ids.tofile(out)
    print(f"{out}: {len(ids):,} tokens (uint16, byte-level: vocabulary 256) from {len(sources)} file(s)")
    return 0


def ensure(path: str | Path) -> Path:
    """``path`` written from the standard library's sources when it is missing, whole: each writer writes a file
    of its own and renames it over ``path``, so processes that find it missing at once each leave it complete."""
    path = Path(path)
    if not path.is_file():
        import os

        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        main([str(tmp)])
        os.replace(tmp, path)
    return path


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
