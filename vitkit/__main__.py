"""`python -m vitkit` is the `vitkit` command."""
from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
