"""Real English text for the examples, byte-level: GCIDE from Debian's dict-gcide.

Source: the Collaborative International Dictionary of English (GCIDE 0.48),
Debian package ``dict-gcide`` (section text, main): ~126,000 entries of
Webster's Revised Unabridged Dictionary (1913, public domain) with WordNet 1.5
and volunteer additions; the GCIDE as a whole is GPL-2+ (its copyright file:
/usr/share/doc/dict-gcide/copyright). The corpus is used as training data only
and is not redistributed with this repository (``.data/`` is ignored by git).

    python examples/text_data.py prepare --out .data/    # needs apt-get or a .deb
    python examples/text_data.py info .data/corpus.bin

``prepare`` fetches the package with ``apt-get download dict-gcide`` (or uses
``--deb FILE``, or an installed /usr/share/dictd/gcide.*), unpacks it with
``dpkg-deb -x``, cuts ``gcide.dict.dz`` into entries with ``gcide.index``,
cleans them, and writes ``corpus.bin`` (~34 MiB) and ``corpus.json``
(provenance). Only ``prepare`` uses the network; training reads
``corpus.bin`` alone.

Cleaning, per entry: the source-attribution lines (``[1913 Webster]``,
``[WordNet 1.5 +PJC]``, ...) are dropped -- ~220,000 identical lines that
teach a model nothing -- the dictd indentation of 3 spaces is removed,
trailing spaces are stripped and runs of blank lines become one. Entries are
joined by a blank line, in dictionary order.

Held-out split (fixed): every 100th entry (entries 99, 199, ...) goes to the
held-out split, so it spans the whole alphabet rather than the letter Z.

corpus.bin layout (little-endian): 8-byte magic ``b"NVFP4TXT"``, uint32
format version (1), uint32 reserved (0), uint64 train length, uint64
held-out length; then the train bytes, then the held-out bytes. A token is
one byte (vocabulary 256).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import shutil
import string
import struct
import subprocess
import tempfile
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = [
    "HELD_OUT_EVERY",
    "clean_entry",
    "decode_b64_number",
    "dictd_entries",
    "encode_b64_number",
    "load_corpus",
    "load_sample",
    "parse_dictd_index",
    "prepare",
    "sample_path",
    "split_entries",
    "write_corpus",
]

MAGIC = b"NVFP4TXT"
VERSION = 1
_HEADER = struct.Struct("<8sIIQQ")  # magic, version, reserved, train, held-out
HELD_OUT_EVERY = 100
PACKAGE = "dict-gcide"
LICENSE = (
    "GPL-2+ (GCIDE, see /usr/share/doc/dict-gcide/copyright in the package); "
    "its Webster 1913 text is public domain"
)

# dictd writes offsets and lengths as base-64 numbers, most significant digit
# first, in this alphabet (the digits of RFC 4648 base64, without padding).
_B64 = string.ascii_uppercase + string.ascii_lowercase + string.digits + "+/"
_B64_VALUE = {c: i for i, c in enumerate(_B64)}

# A line that holds only a source attribution: "[1913 Webster]",
# "[Webster 1913 Suppl. +PJC]", "[WordNet 1.5]", "[PJC]", ... Usage labels on
# their own line ("[Obs.]", "[Colloq.]") are text and stay.
_SOURCE_LINE = re.compile(
    rb"^[ \t]*\[[^\]\n]*(?:Webster|WordNet|PJC)[^\]\n]*\][ \t]*(?:\n|$)",
    re.MULTILINE,
)


# ---------------------------------------------------------------- dictd format


def decode_b64_number(digits: str) -> int:
    """A dictd index number: base-64 digits, most significant first.

    "5I" is 57 * 64 + 8 = 3656 (A-Z are 0-25, a-z 26-51, 0-9 52-61, + 62, / 63).
    """
    value = 0
    for c in digits:
        try:
            value = value * 64 + _B64_VALUE[c]
        except KeyError:
            raise ValueError(f"{digits!r} is not a dictd base-64 number") from None
    return value


def encode_b64_number(value: int) -> str:
    """Inverse of ``decode_b64_number`` (for writing an index)."""
    if value < 0:
        raise ValueError(f"dictd numbers are non-negative, got {value}")
    digits = ""
    while True:
        value, r = divmod(value, 64)
        digits = _B64[r] + digits
        if value == 0:
            return digits


def parse_dictd_index(lines: Iterable[str]) -> list[tuple[str, int, int]]:
    """(headword, byte offset, byte length) for each line of a dictd .index."""
    out = []
    for n, line in enumerate(lines, 1):
        line = line.rstrip("\n")
        if not line:
            continue
        parts = line.split("\t")
        if len(parts) < 3:
            raise ValueError(
                f"index line {n} has {len(parts)} tab-separated fields, expected "
                f"headword, offset, length: {line[:80]!r}"
            )
        out.append((parts[0], decode_b64_number(parts[1]), decode_b64_number(parts[2])))
    return out


def dictd_entries(data: bytes, index: Sequence[tuple[str, int, int]]) -> list[bytes]:
    """The entries of a dictd database, in file order, each once.

    Several headwords may point at one entry (the index has ~204,000 lines for
    ~126,000 entries); the database's own ``00-database-*`` entries (its
    name, URL and notices) are skipped.
    """
    meta = {(o, n) for word, o, n in index if word.startswith("00-database")}
    spans = sorted({(o, n) for _, o, n in index} - meta)
    entries = []
    for offset, length in spans:
        if offset + length > len(data):
            raise ValueError(
                f"index entry at offset {offset} (+{length}) is past the end of "
                f"the {len(data)}-byte database: index and .dict do not match"
            )
        entries.append(data[offset : offset + length])
    return entries


def clean_entry(entry: bytes) -> bytes:
    """One entry as plain text (see the module docstring, "Cleaning")."""
    text = _SOURCE_LINE.sub(b"", entry)
    lines = [line.rstrip() for line in text.split(b"\n")]
    lines = [line[3:] if line.startswith(b"   ") else line for line in lines]
    text = re.sub(rb"\n{3,}", b"\n\n", b"\n".join(lines))
    return text.strip(b"\n")


def split_entries(
    entries: Sequence[bytes], held_out_every: int = HELD_OUT_EVERY
) -> tuple[bytes, bytes]:
    """(train, held-out) texts: entry i is held out when i % every == every - 1.

    Entries are cleaned, empty ones dropped, and each split's entries are
    joined by a blank line (each ends with a newline).
    """
    if held_out_every < 2:
        raise ValueError(f"held_out_every must be >= 2, got {held_out_every}")
    train, held = [], []
    cleaned = (clean_entry(e) for e in entries)
    for i, entry in enumerate(e for e in cleaned if e):
        (held if i % held_out_every == held_out_every - 1 else train).append(entry)
    return b"\n\n".join(train) + b"\n", b"\n\n".join(held) + b"\n"


# -------------------------------------------------------------- corpus file


def write_corpus(path: str, train: bytes, held_out: bytes) -> None:
    """Writes ``corpus.bin`` (layout in the module docstring)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, 0, len(train), len(held_out)))
        f.write(train)
        f.write(held_out)
    os.replace(tmp, path)


def load_corpus(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(train, held_out) byte tokens of a ``corpus.bin``: uint8 1-D arrays.

    The arrays are read-only memory maps of the file (no copy).
    """
    with open(path, "rb") as f:
        header = f.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise ValueError(f"{path} is {len(header)} bytes, shorter than its header")
    magic, version, _, n_train, n_held = _HEADER.unpack(header)
    if magic != MAGIC:
        raise ValueError(
            f"{path} is not a prepared corpus (magic {magic!r}); build one with "
            "`python examples/text_data.py prepare --out .data/`"
        )
    if version != VERSION:
        raise ValueError(f"{path} has format version {version}, expected {VERSION}")
    size = os.path.getsize(path)
    if size != _HEADER.size + n_train + n_held:
        raise ValueError(
            f"{path} is {size} bytes; its header promises {_HEADER.size} + "
            f"{n_train} + {n_held} -- the file is truncated or corrupt, prepare "
            "it again"
        )
    data = np.memmap(path, np.uint8, mode="r", offset=_HEADER.size)
    return data[:n_train], data[n_train:]


# ------------------------------------------------------------------ sources


def sample_path() -> str:
    """The small sample committed with the tests: ``tests/data/gcide_sample``
    (``.dict`` and ``.index``; 1913 Webster entries only, public domain)."""
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(here, os.pardir, os.pardir, "tests", "data", "gcide_sample")


def read_dictd(dict_path: str, index_path: str) -> list[bytes]:
    """The entries of a dictd database (``.dict`` or gzip/dictzip ``.dict.dz``)."""
    opener = gzip.open if dict_path.endswith((".dz", ".gz")) else open
    with opener(dict_path, "rb") as f:
        data = f.read()
    with open(index_path, encoding="utf-8", errors="replace") as f:
        index = parse_dictd_index(f)
    return dictd_entries(data, index)


def load_sample(held_out_every: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """(train, held_out) of the committed sample, split like the corpus but with
    every ``held_out_every``-th entry held out (the sample is small)."""
    base = sample_path()
    train, held = split_entries(
        read_dictd(base + ".dict", base + ".index"), held_out_every
    )
    return np.frombuffer(train, np.uint8), np.frombuffer(held, np.uint8)


def _fetch_deb(workdir: str) -> str:
    if shutil.which("apt-get") is None:
        raise RuntimeError(
            "apt-get is not available: download the Debian package dict-gcide "
            "yourself and pass --deb path/to/dict-gcide_*.deb"
        )
    subprocess.run(
        ["apt-get", "download", PACKAGE], cwd=workdir, check=True, capture_output=True
    )
    debs = [f for f in os.listdir(workdir) if f.startswith(PACKAGE + "_")]
    if len(debs) != 1:
        raise RuntimeError(f"apt-get download left {debs} in {workdir}")
    return os.path.join(workdir, debs[0])


def _unpack_deb(deb: str, workdir: str) -> tuple[str, str]:
    if shutil.which("dpkg-deb") is None:
        raise RuntimeError(
            "dpkg-deb is needed to unpack the .deb (Debian/Ubuntu); or install "
            "dict-gcide and run prepare without --deb"
        )
    root = os.path.join(workdir, "root")
    subprocess.run(["dpkg-deb", "-x", deb, root], check=True)
    base = os.path.join(root, "usr", "share", "dictd", "gcide")
    return base + ".dict.dz", base + ".index"


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def prepare(
    out_dir: str,
    *,
    deb: str | None = None,
    held_out_every: int = HELD_OUT_EVERY,
    max_mib: float = 40.0,
) -> str:
    """Fetches dict-gcide, converts it, writes ``out_dir/corpus.bin`` and
    ``corpus.json``; returns the path of corpus.bin.

    Sources, in order: ``deb`` (a dict-gcide .deb); an installed
    /usr/share/dictd/gcide.{dict.dz,index}; ``apt-get download dict-gcide``.
    The train split is cut at ``max_mib`` MiB (the file has to travel to
    machines without network); the held-out split is never cut.
    """
    installed = "/usr/share/dictd/gcide"
    with tempfile.TemporaryDirectory() as workdir:
        if deb is None and os.path.exists(installed + ".index"):
            dict_path, index_path = installed + ".dict.dz", installed + ".index"
            origin = {"installed": installed + ".dict.dz"}
        else:
            if deb is None:
                deb = _fetch_deb(workdir)
            dict_path, index_path = _unpack_deb(deb, workdir)
            origin = {"deb": os.path.basename(deb), "deb_sha256": _sha256(deb)}
        entries = read_dictd(dict_path, index_path)
    train, held = split_entries(entries, held_out_every)
    limit = int(max_mib * 2**20) - len(held) - _HEADER.size
    truncated = len(train) > limit
    if truncated:
        train = train[:limit]
    path = os.path.join(out_dir, "corpus.bin")
    write_corpus(path, train, held)
    meta = {
        "source": "GCIDE 0.48 (The Collaborative International Dictionary of "
        "English), Debian package dict-gcide",
        "license": LICENSE,
        **origin,
        "entries": len(entries),
        "held_out_every": held_out_every,
        "train_bytes": len(train),
        "held_out_bytes": len(held),
        "train_truncated_to_mib": max_mib if truncated else None,
        "corpus_sha256": _sha256(path),
        "format": "corpus.bin: <8sIIQQ header (magic NVFP4TXT, version, 0, train, "
        "held-out lengths), train bytes, held-out bytes; a token is a byte",
    }
    with open(os.path.join(out_dir, "corpus.json"), "w") as f:
        json.dump(meta, f, indent=2)
    return path


def _info(path: str) -> None:
    train, held = load_corpus(path)
    print(f"{path}: {train.size:,} train bytes, {held.size:,} held-out bytes")
    text = bytes(train[:600]).decode("utf-8", errors="replace")
    print("--- start of the train split ---\n" + text)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="fetch dict-gcide and write corpus.bin")
    p.add_argument("--out", default=".data", help="output directory")
    p.add_argument("--deb", default=None, help="a dict-gcide .deb (skips apt-get)")
    p.add_argument("--held-out-every", type=int, default=HELD_OUT_EVERY)
    p.add_argument("--max-mib", type=float, default=40.0, help="cap on the file")
    i = sub.add_parser("info", help="sizes and the first bytes of a corpus.bin")
    i.add_argument("path", nargs="?", default=".data/corpus.bin")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        path = prepare(
            args.out,
            deb=args.deb,
            held_out_every=args.held_out_every,
            max_mib=args.max_mib,
        )
        with open(os.path.join(args.out, "corpus.json")) as f:
            print(f.read())
        print(f"wrote {path} ({os.path.getsize(path) / 2**20:.1f} MiB)")
    else:
        _info(args.path)
