"""The embedded default: a tiny Llama-style model, a locally built tokenizer and a learnable data set.

Nothing here touches a hub, so tests, the CLI (``--tiny``) and the example run offline.
"""

from __future__ import annotations

import random
import string

TINY_SIZES = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=512, max_position_embeddings=512)

# Characters the task uses; every one becomes a single token.
_ALPHABET = list(string.ascii_lowercase + string.digits + " +-=>:|?.")
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    sizes = {**TINY_SIZES, **overrides}
    return LlamaConfig(**sizes, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def tiny_llama(seed: int = 0, **overrides):
    """A randomly initialised LlamaForCausalLM built from a config (no weights downloaded)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**overrides))
    return model


def char_tokenizer(vocab_size: int = 512):
    """A character-level fast tokenizer built locally (word-level model over single characters)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + _ALPHABET)}
    assert len(vocab) <= vocab_size
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", vocab["<s>"]), ("</s>", vocab["</s>"])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.padding_side = "right"
    return fast


def arithmetic_examples(n: int, seed: int = 0, max_operand: int = 99) -> list[str]:
    """``'12+7=19'`` style lines: learnable quickly, so a falling loss means the wiring works."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice("+-")
        out.append(f"{a}{op}{b}={a + b if op == '+' else a - b}")
    return out


def reverse_examples(n: int, seed: int = 0, length: tuple[int, int] = (3, 12)) -> list[str]:
    """``'abc>cba'`` string reversal lines: a second learnable task with variable length."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        w = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(*length)))
        out.append(f"{w}>{w[::-1]}")
    return out


def make_dataset(tokenizer, n: int = 512, seed: int = 0, task: str = "mixed", pack_to: int | None = None):
    """A ``datasets.Dataset`` of tokenized examples with ``labels`` = ``input_ids`` (causal LM).

    ``pack_to`` joins several examples into one row of about that many tokens, so a batch of the
    benchmark shape (e.g. 8 x 128) carries real work rather than padding.
    """
    from datasets import Dataset

    return Dataset.from_dict(tokenized_columns(tokenizer, n, seed, task, pack_to))


def make_rows(tokenizer, n: int = 512, seed: int = 0, task: str = "mixed", pack_to: int | None = None):
    """:func:`make_dataset`, or the same rows as a list of dicts where the ``datasets`` package is missing (the
    Trainer takes either)."""
    try:
        return make_dataset(tokenizer, n, seed, task, pack_to)
    except ImportError:
        columns = tokenized_columns(tokenizer, n, seed, task, pack_to)
        return [dict(zip(columns, row)) for row in zip(*columns.values())]


def tokenized_columns(tokenizer, n: int = 512, seed: int = 0, task: str = "mixed",
                      pack_to: int | None = None) -> dict[str, list]:
    """The columns of :func:`make_dataset` (``input_ids``, ``attention_mask``), without the ``datasets`` package."""
    if task == "arithmetic":
        texts = arithmetic_examples(n, seed)
    elif task == "reverse":
        texts = reverse_examples(n, seed)
    else:
        texts = [t for pair in zip(arithmetic_examples(n // 2 + 1, seed), reverse_examples(n // 2 + 1, seed + 1))
                 for t in pair][:n]
    if pack_to:
        rows, cur = [], ""
        budget = pack_to - 2  # <s> and </s>
        for t in texts:
            if cur and len(cur) + 1 + len(t) > budget:
                rows.append(cur)
                cur = ""
            cur = f"{cur}|{t}" if cur else t
        if cur:
            rows.append(cur)
        texts = rows
    enc = tokenizer(texts, truncation=True, max_length=pack_to or 128)
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def causal_lm_collator(tokenizer, pad_to_multiple_of: int | None = None):
    """Pads and sets ``labels`` (padding -> -100)."""
    from transformers import DataCollatorForLanguageModeling

    return DataCollatorForLanguageModeling(tokenizer, mlm=False, pad_to_multiple_of=pad_to_multiple_of)


# A chat template the character tokenizer can spell: "u:<question>|a:<answer>|" per turn.
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'][0] }}:{{ message['content'] }}|{% endfor %}"
                 "{% if add_generation_prompt %}a:{% endif %}")


def chat_tokenizer():
    """:func:`char_tokenizer` with :data:`CHAT_TEMPLATE`, for chat-format (``messages``) data sets."""
    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


def chat_dataset(n: int = 512, seed: int = 0):
    """A ``datasets.Dataset`` of ``messages`` (user asks, assistant answers): arithmetic and reversal questions,
    ragged in length (a few characters to a few dozen), learnable in a few dozen steps."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for a, r in zip(arithmetic_examples(n, seed), reverse_examples(n, seed + 1, length=(2, 40))):
        question, answer = (a if rng.random() < 0.5 else r).replace(">", "=").split("=", 1)
        rows.append([{"role": "user", "content": f"{question}?"}, {"role": "assistant", "content": answer}])
    return Dataset.from_dict({"messages": rows[:n]})
