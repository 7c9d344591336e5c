"""Simulate the vocabulary-parallelism paper's setting and print the markdown tables (MFU, peak memory)
for naive placement, layer redistribution, and vocabulary parallelism with the naive algorithm
(``vp-naive``), Algorithm 1 and Algorithm 2; draw MFU against vocabulary.

    PYTHONPATH=src python tools/vocab_paper.py [--schedule 1f1b|v-half] [--microbatches 128] [--png FILE]
        [--attention flash|eager]
"""

from __future__ import annotations

import argparse

from pipewright.features.vocab.experiment import METHODS, VOCABS, Row, table


def markdown(rows: list[Row]) -> str:
    lines = [
        "| seq | V | method | MFU | vs naive | iteration (s) | peak memory (GiB) | lowest rank (GiB) "
        "| layout |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    naive = {(r.seq_len, r.vocab): r.mfu for r in rows if r.method == "naive"}
    for r in rows:
        gain = r.mfu / naive[r.seq_len, r.vocab] - 1
        lines.append(
            f"| {r.seq_len} | {r.vocab // 1024}k | {r.method} | {100 * r.mfu:.1f} % | {100 * gain:+.0f} % "
            f"| {r.iteration_s:.3f} | {r.peak_memory_gib:.1f} | {r.min_memory_gib:.1f} | {r.layout} |"
        )
    return "\n".join(lines)


def plot(rows: list[Row], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seqs = sorted({r.seq_len for r in rows})
    fig, axes = plt.subplots(1, len(seqs), figsize=(5 * len(seqs), 3.6), sharey=True)
    for ax, seq in zip(axes if len(seqs) > 1 else [axes], seqs, strict=True):
        for method in METHODS:
            pts = sorted((r.vocab, r.mfu) for r in rows if r.seq_len == seq and r.method == method)
            ax.plot([v // 1024 for v, _ in pts], [100 * m for _, m in pts], marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xticks([v // 1024 for v in VOCABS], [f"{v // 1024}k" for v in VOCABS])
        ax.set_xlabel("vocabulary")
        ax.set_title(f"{title}, sequence {seq}")
        ax.grid(alpha=0.3)
    (axes[0] if len(seqs) > 1 else axes).set_ylabel("MFU (%)")
    (axes[0] if len(seqs) > 1 else axes).legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--microbatches", type=int, default=128)
    ap.add_argument("--png")
    ap.add_argument("--attention", default="flash", choices=("flash", "eager"), help="as the paper: flash")
    args = ap.parse_args()
    rows = table(args.schedule, microbatches=args.microbatches, attention=args.attention)
    print(markdown(rows))
    if args.png:
        plot(rows, args.png, args.schedule)


if __name__ == "__main__":
    main()
