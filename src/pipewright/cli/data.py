"""``pipewright data prepare``: a token file made with a model's own tokenizer."""

from __future__ import annotations

import argparse

from pipewright.outputs import add_overwrite_flag, check_output


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("data", help="prepare training data")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    prepare = verbs.add_parser(
        "prepare", help="encode text files with a model's tokenizer.json into a token file (.bin)"
    )
    prepare.add_argument("inputs", nargs="+", help="text files or folders (read in path order)")
    prepare.add_argument(
        "--tokenizer", required=True, help="model folder with tokenizer.json (and config.json)"
    )
    prepare.add_argument("-o", "--output", required=True, help="token file to write (.bin + .json sidecar)")
    add_overwrite_flag(prepare)
    prepare.set_defaults(func=_prepare)


def _prepare(args: argparse.Namespace) -> int:
    from pipewright.data.prepare import prepare_tokens
    from pipewright.data.tokens import sidecar_path

    inputs = [*args.inputs, args.tokenizer]
    check_output(args.output, "--output", overwrite=args.overwrite, inputs=inputs)  # a file name, then:
    check_output(sidecar_path(args.output), "--output's sidecar", overwrite=args.overwrite, inputs=inputs)
    path, n, vocab = prepare_tokens(args.inputs, args.tokenizer, args.output)
    print(f"wrote {n} tokens (vocabulary {vocab}) to {path}")
    return 0
