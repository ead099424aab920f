"""``python -m flair_fabric cache list|prune|verify``: a cache folder's entries with their sizes and last use,
removing those no run opened for a while, and reading every entry in full against its record (docs/data.md)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

from flair_fabric.data.cache import default_cache_folder
from flair_fabric.data.errors import CacheFolderError
from flair_fabric.data.housekeeping import Entry, list_entries, prune, verify_entries


def _days(value: str) -> float:
    try:
        days = float(value)
    except ValueError:
        days = -1.0
    if not days >= 0:
        raise argparse.ArgumentTypeError(f"{value!r}: give a number of days, 0 or more (e.g. --older-than 30)")
    return days


def parser() -> argparse.ArgumentParser:
    """The ``cache`` command's parser."""
    main = argparse.ArgumentParser(prog="python -m flair_fabric cache", description=__doc__.split("\n\n")[0])
    actions = main.add_subparsers(dest="action", required=True)
    folder_help = "the cache folder (default: $FLAIR_FABRIC_CACHE, else ~/.cache/flair_fabric/corpora)"
    shown = actions.add_parser("list", help="every entry and temporary folder: size, last use, state")
    pruned = actions.add_parser("prune", help="remove the entries no run opened in the last DAYS days")
    pruned.add_argument("--older-than", type=_days, required=True, metavar="DAYS", help="days since the last use")
    pruned.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    checked = actions.add_parser("verify", help="read every entry in full and compare it with its record")
    for action in (shown, pruned, checked):
        action.add_argument("--cache-folder", type=Path, default=None, help=folder_help)
    return main


def _line(entry: Entry, now: float) -> str:
    days = (now - entry.last_used) / 86400
    return f"{entry.size / 2**20:10.1f} MiB  {days:8.1f} days ago  {entry.state:<40}  {entry.path}"


def _total(entries: list[Entry]) -> str:
    return f"{len(entries)} folder(s), {sum(entry.size for entry in entries) / 2**20:.1f} MiB"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``cache`` command; returns the exit code (1: ``verify`` found a damaged entry)."""
    args = parser().parse_args(argv)
    root = args.cache_folder if args.cache_folder is not None else default_cache_folder()
    if root.exists() and not root.is_dir():
        raise SystemExit(f"--cache-folder {root}: not a folder; pass the cache folder of the corpora.")
    now = time.time()
    if args.action == "list":
        entries = list_entries(root)
        for entry in entries:
            print(_line(entry, now))
        print(f"{root}: {_total(entries)}")
        return 0
    if args.action == "prune":
        try:
            removed, kept = prune(root, args.older_than, dry_run=args.dry_run)
        except CacheFolderError as error:
            raise SystemExit(str(error)) from None
        for entry in removed:
            print(("would remove " if args.dry_run else "removed ") + _line(entry, now))
        for entry in kept:
            print("kept (a build holds its lock) " + _line(entry, now))
        print(f"{root}: {'would remove' if args.dry_run else 'removed'} {_total(removed)}")
        return 0
    results = verify_entries(root)
    for entry, problem in results:
        print(f"{'intact' if problem is None else 'DAMAGED: ' + problem}  {entry.path}")
    damaged = sum(problem is not None for _, problem in results)
    print(f"{root}: {len(results)} entries, {damaged} damaged (a damaged entry is rebuilt when its corpus is opened)")
    return 1 if damaged else 0
