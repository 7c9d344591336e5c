"""PipeFisher: K-FAC tasks (curvature, factor reduction, inversion, preconditioning) placed into the
bubbles of synchronous pipeline schedules (Osawa, Li, Hoefler, MLSys 2023). See docs/pipefisher.md.

``kinds``, ``cost`` and ``fill`` are pure Python; ``factors``, ``kfac`` and ``optimizer`` need torch and
are imported from their modules."""
