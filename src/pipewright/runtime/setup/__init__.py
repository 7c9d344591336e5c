"""Setting a run up before and as its workers start: the training config and its checks, the size
estimate, launching the worker processes, start-up lines, the host allocator and NCCL's rules over gloo.

Torch-free at import (``pipewright train``'s flags are generated from :mod:`.config`)."""
