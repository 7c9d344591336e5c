"""PipeFisher: K-FAC tasks (curvature, factor reduction, inversion, preconditioning) placed into the
bubbles of synchronous pipeline schedules (Osawa, Li, Hoefler, MLSys 2023). See docs/pipefisher.md.

``FEATURE`` is the bundle (:mod:`.feature`). ``kinds``, ``cost``, ``fill``, ``report`` are pure Python;
``factors``, ``kfac``, ``optimizer`` and ``runtime`` need torch and are imported from their modules."""

from pipewright.features.kfac.feature import FEATURE

__all__ = ["FEATURE"]
