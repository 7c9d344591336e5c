"""The vocabulary-parallelism bundle (:class:`pipewright.features.Feature`): kinds and the insertion
pass (the pass sets the schedule's kind registry itself, with F of stage 0 and the last stage's backward
tied to the vocabulary kinds), the options, the ``simulate`` hook and the training plugin (imported by
name when used). This module imports no torch."""

from pipewright.features.bundle import Feature
from pipewright.features.vocab.insert import insert_vocab
from pipewright.features.vocab.kinds import vocab_kinds
from pipewright.features.vocab.options import VocabOptions
from pipewright.runspec.feature_registry import BUILTIN_SECTIONS

FEATURE = Feature(
    name="vocab",
    kinds=vocab_kinds(),
    passes={"vocab": insert_vocab},
    simulate="pipewright.features.vocab.simulate:simulate_hook",
    section=VocabOptions,
    plugin="pipewright.features.vocab.train:VocabPlugin",
    description=BUILTIN_SECTIONS["vocab"].description,
)
