"""``python -m loomflow``: the same command line as the ``loomflow`` script."""

from .cli import main

main()
