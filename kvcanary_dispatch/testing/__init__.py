"""What you need to fuzz the dispatcher on your own GPU: poisoned cases and their checks
(``cases``), hypothesis input strategies (``strategies``, needs the ``[testing]`` extra) and the
property checks (``properties``). Nothing here is imported by ``import kvcanary_dispatch``."""
