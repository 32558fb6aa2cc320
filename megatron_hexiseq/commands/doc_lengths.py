"""``megatron-hexiseq doc-lengths``: the document lengths of a Megatron indexed dataset, as the JSON
list ``plan --doc-lengths`` and ``varlen --doc-lengths`` read."""

from __future__ import annotations

import argparse

from megatron_hexiseq.commands import describe
from megatron_hexiseq.io import check_outputs, write_json_atomic

EXAMPLES = """examples:
  megatron-hexiseq doc-lengths --data-path /data/my-corpus_text_document -o lengths.json
  megatron-hexiseq plan --cluster C.yaml --model llama3-8b --seq-length 131072 \\
      --doc-lengths lengths.json -o layout.json

--data-path takes the prefix Megatron's --data-path takes (PREFIX.bin and PREFIX.idx, written by
Megatron-LM's tools/preprocess_data.py), one or more; only the index is read, with Megatron's own
reader. A document's length counts its EOD token when the data was preprocessed with --append-eod.
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doc-lengths",
        help="document lengths of a Megatron indexed dataset (for --doc-lengths)",
        description=describe(__doc__),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--data-path", required=True, nargs="+", metavar="PREFIX", help="indexed dataset prefix(es)"
    )
    p.add_argument("-o", "--output", required=True, metavar="L.json", help="the length list")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from megatron_hexiseq.varlen.indexed import doc_lengths_of

    inputs = [x + ext for x in args.data_path for ext in (".bin", ".idx")]
    check_outputs([("-o", args.output)], inputs=inputs)
    lengths = doc_lengths_of(args.data_path)
    write_json_atomic(args.output, lengths)
    total = sum(lengths)
    print(
        f"wrote {args.output}: {len(lengths):,} documents, {total:,} tokens, median "
        f"{sorted(lengths)[len(lengths) // 2]:,}, longest {max(lengths):,}"
    )
    return 0
