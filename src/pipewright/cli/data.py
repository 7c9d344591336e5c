"""``pipewright data prepare``: a token file made with a model's own tokenizer (its flags the RunSpec's
``[data_prep]`` and ``-o``/``--overwrite``)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from pipewright.cli.spec_args import add_command

    parser = sub.add_parser("data", help="prepare training data")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    add_command(
        verbs,
        "data prepare",
        _prepare,
        help="encode text files with a model's tokenizer.json into a token file (.bin)",
    )


def _prepare(args: argparse.Namespace) -> int:
    from pipewright.cli.spec_args import required
    from pipewright.data.prepare import prepare_tokens
    from pipewright.data.tokens import sidecar_path
    from pipewright.outputs import check_output

    prep, out = args.spec.data_prep, args.spec.output
    required("data prepare", INPUT=prep.inputs or None, **{"--tokenizer": prep.tokenizer, "-o": out.out})
    inputs = [*prep.inputs, prep.tokenizer]
    check_output(out.out, "--output", overwrite=out.overwrite, inputs=inputs)  # a file name, then:
    check_output(sidecar_path(out.out), "--output's sidecar", overwrite=out.overwrite, inputs=inputs)
    path, n, vocab = prepare_tokens(list(prep.inputs), prep.tokenizer, out.out)
    print(f"wrote {n} tokens (vocabulary {vocab}) to {path}")
    return 0
