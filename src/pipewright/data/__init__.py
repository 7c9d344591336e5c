"""Training data: the default corpus (this Python's standard library, no download), text corpora,
memory-mapped token files, and the ``TokenDataset`` the trainer samples batches from."""

from pipewright.data.data_errors import DataError
from pipewright.data.dataset import TokenDataset, open_dataset
from pipewright.data.tokenizer import TokenizerSpec, parse_tokenizer_spec
from pipewright.data.tokens import open_tokens, write_tokens

__all__ = [
    "DataError",
    "TokenDataset",
    "TokenizerSpec",
    "open_dataset",
    "open_tokens",
    "parse_tokenizer_spec",
    "write_tokens",
]
