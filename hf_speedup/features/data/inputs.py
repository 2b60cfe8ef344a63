"""The training set SpeedupTrainer is handed, checked at construction (the data feature's ``problems`` hook): one
clear error (field, value, allowed values, fix) instead of a traceback at batch 1, or a run that trains on nothing
and looks like success. Not empty; at least one batch where TrainingArguments drop the last partial batch; rows of
one length where the collator only stacks them; label tokens to learn from.

The checks read a sample of rows (the first ``SAMPLE_ROWS``, or ``SAMPLE_ITEMS`` through ``__getitem__``), never
the whole set, and skip what they cannot know (an IterableDataset, a collator of the user's own making).
"""

from __future__ import annotations

from .loaders import drop_last_problem

SEQUENCE_COLUMNS = ("input_ids", "attention_mask", "labels", "token_type_ids", "position_ids")
SAMPLE_ROWS = 256  # rows read from an Arrow-backed datasets.Dataset (a columnar slice: cheap)
SAMPLE_ITEMS = 64  # rows read through __getitem__ of any other Dataset (each may load or tokenize)
IGNORE_INDEX = -100


def _sample(dataset) -> list[dict] | None:
    """The first rows as dicts; None where they cannot be read cheaply and safely (an IterableDataset, rows
    that are not mappings, a dataset that fails to index: the Trainer reports that one itself)."""
    import torch

    if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset):
        return None
    try:
        n = min(len(dataset), SAMPLE_ROWS)
        try:
            from datasets import Dataset
        except ImportError:  # pragma: no cover - datasets comes with the Trainer's usual inputs
            Dataset = ()
        if isinstance(dataset, Dataset):
            cols = [c for c in dataset.column_names if c in SEQUENCE_COLUMNS]
            if not cols:
                return None
            block = dataset.select_columns(cols)[:n]
            return [{c: block[c][i] for c in cols} for i in range(n)]
        rows = [dataset[i] for i in range(min(n, SAMPLE_ITEMS))]
    except Exception:  # a check must not add a failure of its own
        return None
    return rows if all(isinstance(r, dict) for r in rows) else None


def _length(value) -> int | None:
    """Length of a 1-D sequence value (list, tuple, 1-D tensor/array); None for scalars."""
    shape = getattr(value, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) == 1 else None
    if isinstance(value, (list, tuple)) and all(not isinstance(v, (list, tuple)) for v in value[:4]):
        return len(value)
    return None


def _flat(value) -> list:
    return value.reshape(-1).tolist() if hasattr(value, "reshape") else list(value)


def _collator_kind(collator, processing_class) -> str:
    """'stack' (rows only stacked: default_data_collator), 'pad-inputs' (DataCollatorWithPadding: pads
    input_ids/attention_mask, not labels), or 'other' (a padding or user collator: not second-guessed)."""
    from transformers import DataCollatorWithPadding, DefaultDataCollator, PreTrainedTokenizerBase, default_data_collator

    from transformers.feature_extraction_sequence_utils import SequenceFeatureExtractor

    if collator is None:  # what the Trainer builds when given none
        if isinstance(processing_class, SequenceFeatureExtractor):
            return "other"  # it pads its own inputs (audio): not second-guessed
        return "pad-inputs" if isinstance(processing_class, PreTrainedTokenizerBase) else "stack"
    if collator is default_data_collator or isinstance(collator, DefaultDataCollator):
        return "stack"
    if type(collator) is DataCollatorWithPadding:
        return "pad-inputs"
    return "other"


def dataset_problems(dataset, args, *, collator=None, processing_class=None, flattens: bool = False) -> list[str]:
    """Problems of the training set that would fail at batch 1 or make a run learn nothing.

    ``collator`` is the collator the Trainer will use (None: its own default for ``processing_class``);
    ``flattens``: the plan makes padding-free rows (ragged rows are fine then). The plan's own drop_last is not
    in ``args`` (the data feature withdraws that one itself where it would be wrong).
    """
    if dataset is None:
        return []
    try:
        rows = len(dataset)
    except TypeError:
        rows = None
    if rows == 0:
        return ["train_dataset has 0 rows; allowed: a training set with at least one row; fix: check the split, "
                "filter or map that emptied it (e.g. a max-length filter shorter than every row)"]
    problems = []
    import torch

    sized = rows is not None and not isinstance(dataset, torch.utils.data.IterableDataset)
    if getattr(args, "dataloader_drop_last", False) and sized:
        why = drop_last_problem(dataset, args)  # the user's own drop_last: an error (the plan's is withdrawn)
        if why is not None:
            problems.append(f"TrainingArguments.dataloader_drop_last = True: {why}; allowed: at least "
                            "per_device_train_batch_size x processes rows; fix: set dataloader_drop_last=False, or "
                            "a per_device_train_batch_size no larger than the training set")
    sample = _sample(dataset)
    if not sample:
        return problems
    kind = _collator_kind(collator, processing_class)
    if not flattens and kind in ("stack", "pad-inputs"):
        columns = [c for c in SEQUENCE_COLUMNS if c in sample[0]] if kind == "stack" else ["labels"]
        for column in columns:
            lengths = sorted({n for row in sample if (n := _length(row.get(column))) is not None})
            if len(lengths) > 1:
                name = ({"stack": "default_data_collator", "pad-inputs": "DataCollatorWithPadding"}[kind]
                        + (" (the Trainer's default)" if collator is None else ""))
                what = ("only stacks rows" if kind == "stack" else "pads input_ids and attention_mask but not labels")
                problems.append(
                    f"train_dataset rows have different lengths ({column}: {lengths[0]} to {lengths[-1]} tokens in the "
                    f"first {len(sample)} rows) and the collator {name} {what}: batches would fail to stack; allowed: "
                    "rows of one length, or a padding collator; fix: pass data_collator=DataCollatorForLanguageModeling"
                    "(tokenizer, mlm=False) (causal LM: labels from input_ids) or DataCollatorForSeq2Seq(tokenizer) "
                    "(your own labels), or pad the rows to one length")
                break
    labelled = [row["labels"] for row in sample if _length(row.get("labels")) is not None]
    if labelled and all(all(t == IGNORE_INDEX for t in _flat(lab)) for lab in labelled):
        problems.append(
            f"train_dataset labels are all {IGNORE_INDEX} in the first {len(labelled)} rows: the loss ignores every "
            "token, so the run would learn nothing (and report a loss of 0); allowed: rows with some label tokens "
            f"!= {IGNORE_INDEX}; fix: check the masking that builds labels (a prompt template that masks the whole "
            "row, truncation that cuts off every answer)")
    return problems
