"""PipeFisher: K-FAC tasks (curvature, factor reduction, inversion, preconditioning) placed into the
bubbles of synchronous pipeline schedules (Osawa, Li, Hoefler, MLSys 2023). See docs/pipefisher.md.

``FEATURE`` is the bundle (:mod:`.feature`), imported on first use (PEP 562): importing the package (as
reading :mod:`.options` does) imports none of its modules. ``kinds``, ``cost``, ``fill``, ``report``
are pure Python; ``factors``, ``kfac``, ``optimizer`` and ``runtime`` need torch and are imported from
their modules."""

from pipewright.lazy import lazy_attributes

_WHERE = {"FEATURE": "pipewright.features.kfac.feature"}

__all__ = sorted(_WHERE)

__getattr__, __dir__ = lazy_attributes(__name__, _WHERE, globals())
