"""Integrations that patch a serving engine's kv-canary code to use kvcanary-dispatch.

Each integration lives in its own module and imports its engine lazily, inside ``apply()``:
importing ``kvcanary_dispatch`` or this package never imports an engine.

- ``kvcanary_dispatch.integrations.sglang``: ``apply(policy=...)``, ``revert()``,
  ``applied(...)`` for sglang 0.5.23 (the Liger-Kernel ``apply_liger_kernel_to_*`` convention).
"""

from __future__ import annotations

__all__ = ["sglang"]
