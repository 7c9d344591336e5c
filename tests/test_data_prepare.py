"""``pipewright data prepare --tokenizer DIR``: a token file made with a model folder's tokenizer.json."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipewright.cli import main
from pipewright.data import DataError, open_tokens
from pipewright.data.prepare import prepare_tokens


def _model_folder(tmp_path, model_vocab: int | None, eos: int | None = 1):
    """A folder with a word-level tokenizer.json (6 words + [UNK] + [EOS]) and maybe a config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "[EOS]", "the", "cat", "sat", "on", "a", "mat"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path / "model"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    if model_vocab is not None:
        (folder / "config.json").write_text(json.dumps({"vocab_size": model_vocab, "eos_token_id": eos}))
    return folder


def test_prepare_encodes_files_in_order_with_end_of_text(tmp_path):
    folder = _model_folder(tmp_path, model_vocab=16)
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "b.txt").write_text("a cat sat")
    (texts / "a.txt").write_text("the cat sat on the mat dog")
    path, n, vocab = prepare_tokens([texts], folder, tmp_path / "out.bin")
    ids, file_vocab, meta = open_tokens(path)
    want = [2, 3, 4, 5, 2, 7, 0, 1, 6, 3, 4, 1]  # a.txt then b.txt, [EOS] after each; "dog" unknown
    assert list(np.asarray(ids)) == want and n == len(want)
    assert file_vocab == vocab == 16 and meta["tokenizer"] == str(folder)


def test_prepare_cli_and_one_line_errors(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("the cat")
    small = _model_folder(tmp_path, model_vocab=4)  # the tokenizer has 8 tokens
    with pytest.raises(DataError, match="tokenizer has 8 tokens but the model's vocabulary is 4"):
        prepare_tokens([text], small, tmp_path / "x.bin")
    assert main(["data", "prepare", str(text), "--tokenizer", str(small), "-o", str(tmp_path / "x.bin")]) != 0
    err = capsys.readouterr().err.strip()
    assert "vocabulary is 4" in err and "\n" not in err
    with pytest.raises(DataError, match=r"no tokenizer\.json"):
        prepare_tokens([text], tmp_path, tmp_path / "x.bin")
    (small / "config.json").unlink()  # no config: the tokenizer's own vocabulary, no end-of-text
    out = tmp_path / "ok.bin"
    assert main(["data", "prepare", str(text), "--tokenizer", str(small), "-o", str(out)]) == 0
    assert "wrote 2 tokens (vocabulary 8)" in capsys.readouterr().out
    assert list(np.asarray(open_tokens(out)[0])) == [2, 3]
