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

    required("data prepare", INPUT=args.inputs or None, **{"--tokenizer": args.tokenizer, "-o": args.output})
    inputs = [*args.inputs, args.tokenizer]
    check_output(args.output, "--output", overwrite=args.overwrite, inputs=inputs)  # a file name, then:
    check_output(sidecar_path(args.output), "--output's sidecar", overwrite=args.overwrite, inputs=inputs)
    path, n, vocab = prepare_tokens(args.inputs, args.tokenizer, args.output)
    print(f"wrote {n} tokens (vocabulary {vocab}) to {path}")
    return 0
