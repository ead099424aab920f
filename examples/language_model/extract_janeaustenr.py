"""Re-extract the bundled Jane Austen novels from Debian's ``r-cran-janeaustenr`` package, without R.

    apt-get download r-cran-janeaustenr                 # r-cran-janeaustenr_1.0.0-1_all.deb
    dpkg -x r-cran-janeaustenr_1.0.0-1_all.deb /tmp/janeaustenr
    python examples/language_model/extract_janeaustenr.py \\
        /tmp/janeaustenr/usr/lib/R/site-library/janeaustenr/data /tmp/austen

The package keeps the six novels as R "lazy-load" data: ``Rdata.rdx`` (a gzip-compressed, serialised index) and
``Rdata.rdb`` (one compressed, serialised character vector per novel, one element per line of the Project Gutenberg
text). This script reads both with a minimal reader of R's XDR serialisation format (versions 2 and 3, only the
types these files use) and writes each vector as ``<name>.txt`` (UTF-8, the elements joined by ``\\n``, with a final
newline). That is how ``flair_fabric/data/austen/*.txt`` was made; see ``flair_fabric/data/austen/PROVENANCE.md``.
"""

from __future__ import annotations

import argparse
import bz2
import gzip
import lzma
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

_NILVALUE, _REF, _SPECIAL = 254, 255, {242, 249, 250, 251, 252, 253}
_SYM, _LIST, _CHAR, _LGL, _INT, _REAL, _STR, _VEC = 1, 2, 9, 10, 13, 14, 16, 19


class _RReader:
    """Reads the subset of R's XDR serialisation used by lazy-load data of character vectors."""

    def __init__(self, data: bytes) -> None:
        if data[:2] != b"X\n":
            raise ValueError("not an R XDR serialisation (expected the 'X\\n' header)")
        self.data, self.pos = data, 2
        self.refs: list[Any] = []
        version = self._int()
        self.pos += 8  # writer version, minimal reader version
        if version == 3:
            name_length = self._int()
            self.pos += name_length  # the writer's native encoding name
        elif version != 2:
            raise ValueError(f"unsupported R serialisation version {version}")

    def _int(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return value

    def _length(self) -> int:
        length = self._int()
        if length == -1:  # long vector: two more ints
            high, low = self._int(), self._int()
            length = (high << 32) + low
        return length

    def read(self) -> Any:
        flags = self._int()
        kind, has_attr, has_tag = flags & 0xFF, bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if kind == _NILVALUE or kind in _SPECIAL:
            return None
        if kind == _REF:
            index = flags >> 8 or self._int()
            return self.refs[index - 1]
        if kind == _SYM:
            symbol = self.read()
            self.refs.append(symbol)
            return symbol
        if kind == _LIST:  # pairlist: a dict of tag -> value (enough for attributes)
            if has_attr:
                self.read()  # attributes of the pairlist node itself: not needed
            tag = self.read() if has_tag else None
            pairs = {tag: self.read()}
            rest = self.read()
            if isinstance(rest, dict):
                pairs.update(rest)
            return pairs
        if kind == _CHAR:
            length = self._int()
            if length == -1:
                return None
            raw = self.data[self.pos : self.pos + length]
            self.pos += length
            return raw.decode("latin-1" if flags & (1 << 14) else "utf-8")  # LATIN1_MASK is levels bit 2
        if kind in (_LGL, _INT):
            length = self._length()
            values = list(struct.unpack_from(f">{length}i", self.data, self.pos))
            self.pos += 4 * length
        elif kind == _REAL:
            length = self._length()
            values = list(struct.unpack_from(f">{length}d", self.data, self.pos))
            self.pos += 8 * length
        elif kind in (_STR, _VEC):
            values = [self.read() for _ in range(self._length())]
        else:
            raise ValueError(f"unsupported R type {kind} at byte {self.pos - 4}")
        attributes = self.read() if has_attr else {}
        names = attributes.get("names") if isinstance(attributes, dict) else None
        return dict(zip(names, values, strict=True)) if names else values


def _unpack_rdb_entry(blob: bytes, compressed: int) -> bytes:
    """Decompress one ``Rdata.rdb`` entry: a 4-byte big-endian length, then the (compressed) serialisation."""
    (length,) = struct.unpack_from(">I", blob)
    if compressed in (0, 1):  # FALSE / TRUE: zlib
        data = zlib.decompress(blob[4:]) if compressed else blob[4:]
    else:  # 2 (bzip2) or 3 (xz): a type byte follows the length
        method, payload = blob[4:5], blob[5:]
        decoders: dict[bytes, Callable[[bytes], bytes]] = {
            b"Z": zlib.decompress,
            b"2": bz2.decompress,
            b"X": lzma.decompress,
            b"0": bytes,
        }
        data = decoders[method](payload)
    if len(data) != length:
        raise ValueError(f"entry decompressed to {len(data)} bytes, its header says {length}")
    return data


def extract(data_dir: Path, out_dir: Path) -> dict[str, int]:
    """Write every character vector in ``data_dir/Rdata.{rdx,rdb}`` to ``out_dir/<name>.txt``; return line counts."""
    index = _RReader(gzip.decompress((data_dir / "Rdata.rdx").read_bytes())).read()
    compressed = index["compressed"][0]
    rdb = (data_dir / "Rdata.rdb").read_bytes()
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, (offset, size) in index["variables"].items():
        value = _RReader(_unpack_rdb_entry(rdb[offset : offset + size], compressed)).read()
        if not isinstance(value, list) or not all(isinstance(line, str) or line is None for line in value):
            raise ValueError(f"{name} is not a character vector")
        lines = [line or "" for line in value]
        (out_dir / f"{name}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        counts[name] = len(lines)
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data_dir", type=Path, help="the package's data folder, holding Rdata.rdx and Rdata.rdb")
    parser.add_argument("out_dir", type=Path, help="where to write <name>.txt")
    args = parser.parse_args(argv)
    for name, count in extract(args.data_dir, args.out_dir).items():
        print(f"{name}.txt: {count} lines")


if __name__ == "__main__":
    main()
