"""What you need to fuzz the dispatcher on your own GPU: poisoned cases and their checks
(``cases``), hypothesis input strategies (``strategies``, needs the ``[testing]`` extra), the
property checks (``properties``), and an engine's forward steps with their checks
(``engine_steps``). Nothing here is imported by ``import kvcanary_dispatch``.

``strategies`` and ``properties`` re-export the modules they are split into by role: ``sizes``,
``scatter_inputs`` and ``plan_inputs``; ``launches`` (recording and block checks), ``equality``
and ``rejections``."""
