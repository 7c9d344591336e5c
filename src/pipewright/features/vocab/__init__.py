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

``FEATURE`` is the bundle for :mod:`pipewright.features` (kinds and the insertion pass; the pass sets
the schedule's kind registry itself, with F of stage 0 and the last stage's backward tied to the
vocabulary kinds). This module imports no torch.
"""

from pipewright.features import Feature
from pipewright.features.vocab.insert import insert_vocab
from pipewright.features.vocab.kinds import ALGORITHMS, vocab_kinds
from pipewright.features.vocab.options import VocabOptions

__all__ = ["ALGORITHMS", "FEATURE", "insert_vocab"]


FEATURE = Feature(
    name="vocab",
    kinds=vocab_kinds(),
    passes={"vocab": insert_vocab},
    simulate="pipewright.features.vocab.simulate:simulate_hook",
    section=VocabOptions,
    plugin="pipewright.features.vocab.train:VocabPlugin",
    description="vocabulary parallelism: embedding and output layer split over all pipeline ranks",
)
