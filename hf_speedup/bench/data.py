"""The rows every variant trains on, made at run time (or read from the user's file), identical for all.

- ``ragged``: lengths drawn log-uniform in [16, min(512, seq_len)] — many short rows, a few long ones, as
  in real fine-tuning sets — so padding (and what a variant does about it) shows in the numbers;
- ``fixed``: every row exactly ``seq_len`` real tokens (packed text), no padding anywhere;
- ``docs-chat``: single-turn chat conversations of real text (this Python's standard library documentation),
  rendered with the model's chat template, 40-1024 tokens, median ~350 (:mod:`.chat_data`); the bench builds
  them once in the parent and every worker reads the same file;
- a file: ``.jsonl``/``.json`` objects with ``text`` (tokenized here) or ``input_ids``, or ``.txt`` lines;
  rows are cut to ``seq_len``.

The text of ``ragged`` and ``fixed`` is the embedded arithmetic / reversal task, so the loss falls within a few dozen steps.
"""

from __future__ import annotations

import json
import math
import random

RAGGED_RANGE = (16, 512)  # ragged rows: lengths log-uniform in [16, min(512, seq_len)]


def token_stream(tokenizer, n_tokens: int, seed: int = 0) -> list[int]:
    """At least ``n_tokens`` ids of the embedded task's text, in the given tokenizer."""
    from ..tiny import arithmetic_examples, reverse_examples

    ids: list[int] = []
    chunk = 0
    while len(ids) < n_tokens:
        n = max(256, (n_tokens - len(ids)) // 4)
        pieces = [t for pair in zip(arithmetic_examples(n, seed + chunk), reverse_examples(n, seed + chunk + 1))
                  for t in pair]
        ids.extend(tokenizer("|".join(pieces) + "|", add_special_tokens=False)["input_ids"])
        chunk += 2
    return ids


def ragged_lengths(n: int, seq_len: int, seed: int = 0) -> list[int]:
    """``n`` lengths, log-uniform in [16, min(512, seq_len)]."""
    hi = min(RAGGED_RANGE[1], seq_len)
    lo = min(RAGGED_RANGE[0], hi)
    rng = random.Random(seed)
    return [int(round(math.exp(rng.uniform(math.log(lo), math.log(hi))))) for _ in range(n)]


def make_rows(tokenizer, kind: str, n_rows: int, seq_len: int, seed: int = 0) -> list[dict]:
    """``n_rows`` rows of ``input_ids`` + ``attention_mask`` (all ones: no row carries padding)."""
    if kind == "ragged":
        lengths = ragged_lengths(n_rows, seq_len, seed)
    elif kind == "fixed":
        lengths = [seq_len] * n_rows
    elif kind == "docs-chat":
        from .chat_data import rows_for_run

        return [{"input_ids": r["input_ids"], "attention_mask": r["attention_mask"]}
                for r in rows_for_run(tokenizer, n_rows, seq_len, seed)]
    else:
        return file_rows(kind, tokenizer, seq_len)
    stream = token_stream(tokenizer, sum(lengths), seed)
    rows, pos = [], 0
    for length in lengths:
        ids = stream[pos:pos + length]
        pos += length
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids)})
    return rows


def read_records(path: str) -> list:
    """The file's records; a ValueError naming the file, the record and the fix for anything else."""
    with open(path) as fh:
        if path.endswith(".txt"):
            return [{"text": line.rstrip("\n")} for line in fh if line.strip()]
        try:
            records = [json.loads(line) for line in fh if line.strip()] if path.endswith(".jsonl") else json.load(fh)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--data {path}: not valid JSON ({exc.msg}, line {exc.lineno}); fix: one JSON object "
                             "per line (.jsonl) or one list of objects (.json)") from None
    if not isinstance(records, list):
        raise ValueError(f"--data {path}: a .json file must hold a list of objects; fix: wrap the records in [...]")
    for i, rec in enumerate(records):
        if not (isinstance(rec, dict) and ("input_ids" in rec or isinstance(rec.get("text"), str))):
            raise ValueError(f"--data {path}: record {i} has neither 'text' (a string) nor 'input_ids'; fix: give "
                             "every record one of them")
    return records


def file_rows(path: str, tokenizer, seq_len: int) -> list[dict]:
    """Rows from a ``.jsonl``/``.json`` (``text`` or ``input_ids`` per object) or ``.txt`` (one per line) file."""
    rows = []
    for rec in read_records(path):
        if "input_ids" in rec:
            ids = list(rec["input_ids"])
        else:
            ids = tokenizer(rec["text"], add_special_tokens=True)["input_ids"]
        ids = ids[:seq_len]
        if len(ids) >= 2:
            rows.append({"input_ids": ids, "attention_mask": [1] * len(ids)})
    return rows


def as_dataset(rows: list[dict]):
    from datasets import Dataset

    return Dataset.from_list(rows)
