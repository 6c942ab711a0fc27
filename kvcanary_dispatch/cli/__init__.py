"""The ``kvcanary-dispatch`` command (``python -m kvcanary_dispatch``): ``sweep``, ``fuzz`` and
``explain``, with the timing, workload and results code they use. Needs the ``[cli]`` extra
(matplotlib for the sweep's plot, hypothesis for ``fuzz``); a subcommand whose dependency is
missing says so. Nothing here is imported by ``import kvcanary_dispatch``."""

from .command import main
from .parser import build_parser

__all__ = ["build_parser", "main"]
