"""`python -m mambakit ...` is the `mambakit` command (and `torchrun ... -m mambakit train`)."""

from .cli import main

raise SystemExit(main())
