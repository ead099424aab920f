"""``python -m flair_fabric``: see :mod:`flair_fabric.cli`."""

from flair_fabric.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
