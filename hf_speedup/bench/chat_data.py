"""``--data docs-chat``: single-turn chat rows of real English text, built offline from this Python's own
documentation, at the lengths of real chat fine-tuning sets (a median of a few hundred tokens).

Where the text comes from (nothing is downloaded):

- the docstrings of the public functions, classes and methods of the standard library modules importable here
  (``sys.stdlib_module_names``, ``inspect.getdoc``, each docstring once), and each module's own docstring;
- the language reference's topics that ``help()`` shows (``pydoc_data.topics``), cut at paragraphs.

Each conversation is a user question ("What does `json.dumps` do?", "Explain these from Python's `os.path`
module: ...") and the documentation as the assistant's answer. Short docstrings of one module are combined into
one answer, and long texts cut at paragraphs, until the answer reaches a length drawn log-uniform in
:data:`ANSWER_CHARS`: that sets the median near 300 tokens of SmolLM2's tokenizer (see ``python -m
hf_speedup.bench.chat_data --model PATH``, which prints the distribution). Rows are rendered with the tokenizer's
chat template (a plain ``User: ...\\nAssistant: ...`` when it has none), tokenized, and kept when they hold
:data:`TOKEN_RANGE` tokens (at most ``seq_len``); longer ones are dropped, not cut.

Deterministic for one Python build: modules, objects and topics are read in sorted order and every random choice
comes from ``random.Random(seed)``. Another Python version has other docstrings, so other rows: the bench notes
give the rows' fingerprint.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import io
import json
import math
import random
import statistics
import sys
import warnings
from dataclasses import dataclass

TOKEN_RANGE = (40, 1024)  # tokens per rendered conversation kept
ANSWER_CHARS = (250, 4000)  # an answer grows (combined docstrings, topic paragraphs) to a length drawn log-uniform here
# Modules whose import does something (opens a browser, prints, starts a GUI or a test run) or that are not
# documentation of the language: never imported here.
SKIP_MODULES = frozenset({"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "__main__", "test",
                          "ensurepip", "venv", "lib2to3", "pydoc_data", "xxsubtype", "xxlimited", "msilib", "winreg",
                          "winsound", "msvcrt", "nt", "_winapi", "__phello__", "pip", "idle"})
PLAIN_TEMPLATE = "User: {question}\nAssistant: {answer}"  # when the tokenizer has no chat template


@dataclass(frozen=True)
class Doc:
    module: str
    name: str  # dotted name inside the module ('' for the module itself)
    signature: str
    text: str

    @property
    def title(self) -> str:
        return f"{self.module}.{self.name}" if self.name else self.module


# ------------------------------------------------------------------------------------------- the text
def stdlib_modules() -> list:
    """The standard library modules importable here, sorted by name (private and side-effect ones left out)."""
    out = []
    for name in sorted(getattr(sys, "stdlib_module_names", ())):
        if name.startswith("_") or name in SKIP_MODULES:
            continue
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                    contextlib.redirect_stderr(io.StringIO()):
                warnings.simplefilter("ignore")
                out.append(importlib.import_module(name))
        except BaseException:  # noqa: BLE001 - not importable here (missing C library, platform): not in the set
            continue
    return out


def _signature(obj) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""


def _own(obj, module) -> bool:
    return getattr(obj, "__module__", None) == module.__name__ or module.__name__ == "builtins"


def module_docs(module) -> list[Doc]:
    """The module's docstring, then its public functions and classes (defined in it), each class followed by
    its public methods with docstrings of their own; in name order."""
    docs = []
    if (text := inspect.getdoc(module)):
        docs.append(Doc(module.__name__, "", "", text))
    names = sorted(n for n in dir(module) if not n.startswith("_"))
    for name in names:
        obj = getattr(module, name, None)
        if not (inspect.isroutine(obj) or inspect.isclass(obj)) or not _own(obj, module):
            continue
        if (text := inspect.getdoc(obj)):
            docs.append(Doc(module.__name__, name, _signature(obj), text))
        if inspect.isclass(obj):
            for attr in sorted(a for a in vars(obj) if not a.startswith("_")):
                member = vars(obj)[attr]
                if inspect.isroutine(member) and (text := getattr(member, "__doc__", None)):
                    docs.append(Doc(module.__name__, f"{name}.{attr}", _signature(member), inspect.cleandoc(text)))
    return docs


def all_docs() -> list[Doc]:
    """Every docstring of the standard library here, each text once (the first place it appears)."""
    seen: set[str] = set()
    out = []
    for module in stdlib_modules():
        for doc in module_docs(module):
            if doc.text not in seen:
                seen.add(doc.text)
                out.append(doc)
    return out


def topics() -> list[tuple[str, str]]:
    """The language reference topics ``help()`` shows, (name, text), sorted by name, each text once."""
    from pydoc_data.topics import topics as table

    seen: set[str] = set()
    out = []
    for name in sorted(table):
        text = table[name].strip()
        if text and text not in seen:
            seen.add(text)
            out.append((name, text))
    return out


# ------------------------------------------------------------------------------------ conversations
def _target(rng: random.Random) -> int:
    lo, hi = ANSWER_CHARS
    return int(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def _entry(doc: Doc) -> str:
    head = f"`{doc.title}{doc.signature}`" if doc.name else f"The `{doc.module}` module"
    return f"{head}\n\n{doc.text}"


def _doc_question(group: list[Doc], rng: random.Random) -> str:
    if len(group) == 1 and not group[0].name:
        return rng.choice(["What is Python's `{m}` module for?", "Explain the `{m}` module of the Python standard "
                           "library.", "What can I do with the `{m}` module?"]).format(m=group[0].module)
    if len(group) == 1:
        return rng.choice(["What does `{t}` do in Python?", "How do I use `{t}`?",
                           "Explain `{t}` from the `{m}` module."]).format(t=group[0].title, m=group[0].module)
    names = [f"`{d.name or d.module}`" for d in group]
    listed = ", ".join(names[:-1]) + f" and {names[-1]}"
    return rng.choice(["Explain these from Python's `{m}` module: {n}.", "What do {n} in `{m}` do?",
                       "Give me the documentation of {n} from the `{m}` module."]).format(m=group[0].module, n=listed)


def doc_conversations(docs: list[Doc], rng: random.Random) -> list[tuple[str, str]]:
    """Consecutive docstrings of one module combined until the answer reaches its drawn length."""
    out: list[tuple[str, str]] = []
    group: list[Doc] = []
    target = _target(rng)

    def flush():
        nonlocal group, target
        if group:
            out.append((_doc_question(group, rng), "\n\n".join(_entry(d) for d in group)))
        group, target = [], _target(rng)

    for doc in docs:
        if group and (doc.module != group[0].module or not doc.name):
            flush()
        group.append(doc)
        if sum(len(d.text) for d in group) >= target:
            flush()
    flush()
    return out


def topic_conversations(items: list[tuple[str, str]], rng: random.Random) -> list[tuple[str, str]]:
    """A topic's paragraphs packed into answers of drawn lengths (part 2, 3, ... of a long one)."""
    out = []
    for name, text in items:
        paragraphs = [p for p in text.split("\n\n") if p.strip()]
        parts, current, target = [], [], _target(rng)
        for para in paragraphs:
            current.append(para)
            if sum(len(p) for p in current) >= target:
                parts.append(current)
                current, target = [], _target(rng)
        if current:
            parts.append(current)
        subject = name.replace("-", " ")
        for i, part in enumerate(parts):
            question = rng.choice(["Explain {s} in Python.", "What does the Python language reference say about {s}?",
                                   "How does {s} work in Python?"]).format(s=subject)
            if len(parts) > 1:
                question += f" (part {i + 1} of {len(parts)})"
            out.append((question, "\n\n".join(part)))
    return out


def conversations(seed: int = 0) -> list[tuple[str, str]]:
    """(question, answer) pairs of the whole set, in a seeded order."""
    rng = random.Random(seed)
    pairs = doc_conversations(all_docs(), rng) + topic_conversations(topics(), rng)
    rng.shuffle(pairs)
    return pairs


# ---------------------------------------------------------------------------------------------- rows
def render(tokenizer, question: str, answer: str) -> list[int]:
    """One conversation in the tokenizer's chat template (or :data:`PLAIN_TEMPLATE`), as token ids."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": question},
                                              {"role": "assistant", "content": answer}], tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(PLAIN_TEMPLATE.format(question=question, answer=answer))["input_ids"])


def build_rows(tokenizer, seq_len: int = TOKEN_RANGE[1], seed: int = 0, limit: int | None = None) -> list[dict]:
    """Every conversation that renders to ``TOKEN_RANGE`` tokens (at most ``seq_len``), in the seeded order;
    the first ``limit`` when given. Each row: ``input_ids``, ``attention_mask`` (all ones) and ``source``."""
    lo, hi = TOKEN_RANGE[0], min(TOKEN_RANGE[1], seq_len)
    rows = []
    for question, answer in conversations(seed):
        ids = render(tokenizer, question, answer)
        if lo <= len(ids) <= hi:
            rows.append({"input_ids": ids, "attention_mask": [1] * len(ids), "question": question})
            if limit is not None and len(rows) >= limit:
                break
    return rows


def rows_for_run(tokenizer, n_rows: int, seq_len: int, seed: int = 0) -> list[dict]:
    """``n_rows`` rows for a bench run: the first of the seeded order, repeated from the start if the set is
    smaller than the run (it is not at bench sizes: several thousand rows)."""
    rows = build_rows(tokenizer, seq_len, seed, limit=n_rows)
    if not rows:
        raise ValueError(f"--data docs-chat: no conversation fits {TOKEN_RANGE[0]}..{min(TOKEN_RANGE[1], seq_len)} "
                         "tokens; fix: raise --seq-len (e.g. 1024)")
    return [rows[i % len(rows)] for i in range(n_rows)]


def distribution(lengths: list[int]) -> dict:
    """min / median / p90 / max / mean and the count of token lengths."""
    s = sorted(lengths)
    return {"rows": len(s), "tokens": sum(s), "min": s[0], "median": statistics.median(s),
            "p90": s[min(len(s) - 1, math.ceil(0.9 * len(s)) - 1)], "max": s[-1], "mean": sum(s) / len(s)}


def fingerprint(rows: list[dict]) -> str:
    """The first 12 hex digits of the SHA-256 of the rows' token ids: equal fingerprints, equal rows."""
    return hashlib.sha256(json.dumps([r["input_ids"] for r in rows]).encode()).hexdigest()[:12]


def describe(rows: list[dict]) -> str:
    d = distribution([len(r["input_ids"]) for r in rows])
    return (f"{d['rows']:,} rows, {d['tokens']:,} tokens; tokens per row min {d['min']}, median {d['median']:.0f}, "
            f"p90 {d['p90']}, max {d['max']} (fingerprint {fingerprint(rows)})")


def main(argv: list[str] | None = None) -> int:
    """``python -m hf_speedup.bench.chat_data [--model PATH] [--out FILE.jsonl]``: build the set, print its
    length distribution, optionally write it (``input_ids`` per line: ``hf-speedup bench --data FILE``)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m hf_speedup.bench.chat_data", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="tokenizer of this model (hub id, folder or .gguf); default: the tiny one")
    p.add_argument("--seq-len", type=int, default=TOKEN_RANGE[1])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the rows here (.jsonl)")
    a = p.parse_args(argv)
    if a.model:
        from ..loading import load_tokenizer

        tok = load_tokenizer(a.model)
    else:
        from ..tiny import char_tokenizer

        tok = char_tokenizer()
    rows = build_rows(tok, a.seq_len, a.seed)
    print(f"docs-chat (Python {sys.version.split()[0]}): {describe(rows)}")
    if a.out:
        with open(a.out, "w") as fh:
            for r in rows:
                fh.write(json.dumps({"input_ids": r["input_ids"]}) + "\n")
        print(f"written: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
