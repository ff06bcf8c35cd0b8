"""``python -m attnkit``: the same command line as the ``attnkit`` console script."""
from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
