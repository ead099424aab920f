"""Memory-mapped corpora: flair corpora stored once per machine as Arrow files and read on demand (docs/data.md)."""

from flair_fabric.data.cache import default_cache_folder
from flair_fabric.data.columns import FORMAT_VERSION
from flair_fabric.data.corpus import MappedCorpus, map_corpus
from flair_fabric.data.errors import (
    CacheFolderError,
    DamagedCacheError,
    MalformedLineError,
    SourceChangedError,
    UnsupportedDataPointError,
)
from flair_fabric.data.split import MappedSplit
from flair_fabric.data.stored import StoredSplit, builds_anew, stored_lengths

__all__ = [
    "FORMAT_VERSION",
    "CacheFolderError",
    "DamagedCacheError",
    "MalformedLineError",
    "MappedCorpus",
    "MappedSplit",
    "SourceChangedError",
    "StoredSplit",
    "UnsupportedDataPointError",
    "builds_anew",
    "default_cache_folder",
    "map_corpus",
    "stored_lengths",
]
