"""Read back what an offline W&B run logged: its history rows, from the run's ``.wandb`` file.

wandb 0.31 keeps an offline run only in that binary log and ships no Python reader for it. The file is a LevelDB-style
log (a 7-byte header ``:W&B``, 0xBEE1, version; 32 KiB blocks of records, each a 7-byte header: CRC32, length, kind
FULL/FIRST/MIDDLE/LAST) of wandb's ``Record`` protocol buffers; a history record holds one ``wandb.log`` call.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7
FULL, LAST = 1, 4


def _records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is no W&B run log"
    position, pending = HEADER, b""
    while position + HEADER <= len(data):
        left = BLOCK - position % BLOCK
        if left < HEADER:  # a block's tail too short for a record header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + HEADER])
        if length == 0 and kind == 0:
            position += left
            continue
        pending += data[position + HEADER : position + HEADER + length]
        position += HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def history(run_folder: Path) -> list[dict[str, Any]]:
    """The run's history rows in the order they were logged: ``{key: value, ...}`` (``_step`` included)."""
    rows = []
    for record in _records(next(run_folder.glob("run-*.wandb"))):
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows
