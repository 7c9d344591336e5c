"""Vocabulary parallelism (Yeung et al., "Balancing Pipeline Parallelism with Vocabulary Parallelism",
arXiv 2411.05288): the input embedding and the output layer with its cross-entropy split along the
vocabulary over all p·t pipeline × tensor ranks.

- :mod:`.shard`: the math on one shard (pure functions, torch), exact against the unpartitioned layers;
- :mod:`.layers`: the same over a torch.distributed group, asynchronous collectives;
- :mod:`.kinds`, :mod:`.insert`: the schedule side (action kinds and the pass that places them);
- :mod:`.cost`: FLOPs, time and memory of the passes and of the baselines (pure Python);
- :mod:`.runtime`: executor handlers and stage modules; :mod:`.train`: the training plugin;
- :mod:`.options`: the options (``[vocab]``; ``--vocab-parallel`` on ``train`` and ``simulate``);
  :mod:`.simulate`: what ``simulate --vocab-parallel`` does.

``FEATURE`` is the bundle for :mod:`pipewright.features` (:mod:`.feature`). The names below are
imported on first use (PEP 562): importing the package (as reading :mod:`.options` does) imports none
of its modules.
"""

from pipewright.lazy import lazy_attributes

_WHERE = {
    "ALGORITHMS": "pipewright.features.vocab.kinds",
    "FEATURE": "pipewright.features.vocab.feature",
    "insert_vocab": "pipewright.features.vocab.insert",
}

__all__ = sorted(_WHERE)

__getattr__, __dir__ = lazy_attributes(__name__, _WHERE, globals())
