"""``python -m plugvisor`` is the ``plugvisor`` command (the demo starts plugins this way)."""

from plugvisor.cli import main

main()
