"""Vocabulary parallelism (Yeung et al., "Balancing Pipeline Parallelism with Vocabulary Parallelism",
arXiv 2411.05288): the input embedding and the output layer with its cross-entropy split along the
vocabulary over all p·t pipeline × tensor ranks.

- :mod:`.shard`: the math on one shard (pure functions, torch), exact against the unpartitioned layers;
- :mod:`.layers`: the same over a torch.distributed group, asynchronous collectives;
- :mod:`.kinds`, :mod:`.insert`: the schedule side (action kinds and the pass that places them);
- :mod:`.cost`: FLOPs, time and memory of the passes and of the baselines (pure Python).
"""

ALGORITHMS = ("naive", "alg1", "alg2")
