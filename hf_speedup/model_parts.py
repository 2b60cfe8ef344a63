"""The parts of a model that decide what a feature may do to it: its task head, its mixture-of-experts weights
and routers, its attention-logit softcapping, and how the stock Trainer counts its loss's tokens.

Read from the live (or meta-device) model and its config, never from a checkpoint; :mod:`.model_info` carries
the results in :class:`~hf_speedup.model_info.ModelInfo`.
"""

from __future__ import annotations

from torch import nn

# The task heads hf_speedup tells apart, each with the transformers auto-mapping that lists its classes and the
# class-name endings used where a class is not in a mapping (remote code). Checked in this order: a class that
# several mappings list (``XLMWithLMHeadModel``) takes the first.
HEADS = (
    ("sequence_classification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", ("ForSequenceClassification",)),
    ("token_classification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", ("ForTokenClassification",)),
    ("question_answering", "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", ("ForQuestionAnswering",)),
    ("causal_lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", ("ForCausalLM", "LMHeadModel")),
    ("masked_lm", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", ("ForMaskedLM",)),
    ("causal_lm", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", ()),  # a VLM generates text as a causal LM
)
# Heads whose weights a pretrained checkpoint of another task does not hold: they start random and must train.
NEW_HEADS = ("sequence_classification", "token_classification", "question_answering")


def _mapped_classes(mapping_name: str) -> set[str]:
    from transformers.models.auto import modeling_auto

    out: set[str] = set()
    for v in getattr(modeling_auto, mapping_name, {}).values():
        out.update(v if isinstance(v, (list, tuple)) else (v,))
    return out


def head_kind(model: nn.Module) -> str:
    """The model's task head: ``causal_lm``, ``masked_lm``, ``seq2seq_lm``, ``sequence_classification``,
    ``token_classification``, ``question_answering``, or ``none`` (a bare backbone, a plain module). A subclass
    (your ``class MyLM(LlamaForCausalLM)``) has its base class's head."""
    classes = [c.__name__ for c in type(model).__mro__ if c.__module__.split(".")[0] != "torch" and c is not object]
    seq2seq = getattr(getattr(model, "config", None), "is_encoder_decoder", False)
    for cls in classes:
        for kind, mapping, endings in HEADS:
            if cls in _mapped_classes(mapping) or (endings and cls.endswith(endings)):
                return "seq2seq_lm" if seq2seq and kind in ("causal_lm", "masked_lm") else kind
    return "seq2seq_lm" if seq2seq and any("Generation" in c or "LM" in c for c in classes) else "none"


HEAD_NAMES = {"none": "no task head hf_speedup knows", "causal_lm": "a causal-LM head", "masked_lm": "a masked-LM head",
              "seq2seq_lm": "an encoder-decoder LM head", "sequence_classification": "a sequence-classification head",
              "token_classification": "a token-classification head",
              "question_answering": "a question-answering head"}


def head_modules(model: nn.Module) -> tuple[str, ...]:
    """Names of the top-level modules outside the pretrained backbone that hold parameters: the task head
    (``score``; ``classifier``; ``pre_classifier`` + ``classifier``; ``lm_head``)."""
    backbone = getattr(model, "base_model_prefix", "") or ""
    return tuple(name for name, child in model.named_children()
                 if name != backbone and any(True for _ in child.parameters()))


# ----------------------------------------------------------------------------------------- mixture of experts
def expert_parameters(block: nn.Module) -> tuple[str, ...]:
    """Block-relative names of fused expert weights: 3-D parameters (experts x out x in), which transformers 5
    keeps outside any ``nn.Linear`` (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``)."""
    out = []
    for name, module in block.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if p.dim() == 3:
                path = ".".join(part for part in f"{name}.{pname}".split(".") if part and part != "base_layer")
                if path not in out:
                    out.append(path)
    return tuple(out)


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The experts modules whose ``forward`` dispatches through transformers' ``ExpertsInterface`` (classes made
    with ``@use_experts_implementation``: ``config._experts_implementation`` picks the loop or a grouped kernel)."""
    out = []
    for name, module in model.named_modules():
        forward = type(module).forward
        code = getattr(forward, "__code__", None)
        if getattr(forward, "__wrapped__", None) is not None and code is not None and \
                code.co_filename.replace("\\", "/").endswith("integrations/moe.py"):
            out.append((name, module))
    return out


def experts_implementation(model: nn.Module) -> str | None:
    """``_experts_implementation`` of the config the first dispatching experts module reads (None: none)."""
    found = experts_modules(model)
    return getattr(getattr(found[0][1], "config", None), "_experts_implementation", None) if found else None


ROUTER_NAMES = ("gate", "router", "shared_expert_gate")


def routers(block: nn.Module) -> tuple[str, ...]:
    """Block-relative names of the routers of a mixture-of-experts block (``mlp.gate``): the module that scores
    the experts for each token (a ``...Router`` class, or a module named gate/router beside the experts), and a
    shared expert's scalar gate. Empty for a dense block."""
    if not expert_parameters(block) and not any(n.split(".")[-1] == "experts" for n, _ in block.named_modules()):
        return ()
    found: list[str] = []
    for name, module in block.named_modules():
        if not name or any(name.startswith(r + ".") for r in found):
            continue
        if "Router" in type(module).__name__ or name.split(".")[-1] in ROUTER_NAMES:
            found.append(name)
    return tuple(found)


# ----------------------------------------------------------------------------------------- attention and loss
def attention_softcap(config) -> float | None:
    """Gemma 2's ``attn_logit_softcapping``: attention scores squashed by ``cap * tanh(s / cap)`` before the
    softmax, which torch's scaled_dot_product_attention cannot apply."""
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    cap = getattr(text, "attn_logit_softcapping", None)
    return float(cap) if isinstance(cap, (int, float)) and cap else None


def value_head_dim(config) -> int | None:
    """The value head size where it differs from the query/key one (multi-head latent attention: DeepSeek V2/V3
    attend with 192-wide queries and keys over 128-wide values); None where they are equal or not stated."""
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    v = getattr(text, "v_head_dim", None)
    if not isinstance(v, int):
        return None
    qk = getattr(text, "qk_head_dim", None)
    if not isinstance(qk, int):
        nope, rope = getattr(text, "qk_nope_head_dim", None), getattr(text, "qk_rope_head_dim", None)
        qk = nope + rope if isinstance(nope, int) and isinstance(rope, int) else getattr(text, "head_dim", None)
    return v if isinstance(qk, int) and qk != v else None


def miscounted_loss(model: nn.Module) -> str:
    """Why the stock Trainer's loss of padded causal-LM batches is not the mean over the real targets ("" where it
    is). The Trainer counts a batch's targets over ``labels[..., 1:]`` only when the model's ``loss_type`` maps to
    ``ForCausalLMLoss``; a class with no recognised ``loss_type`` (GPT-2's ``GPT2LMHeadModel``, ``BertLMHeadModel``)
    still computes ``ForCausalLMLoss`` (transformers' fallback) but is counted over every label, the first token of
    each row included, although a causal LM never predicts it."""
    if head_kind(model) != "causal_lm" or not hasattr(model, "loss_type") or "_loss_function" in vars(model):
        return ""
    from transformers.loss.loss_utils import LOSS_MAPPING

    if model.loss_type in LOSS_MAPPING:
        return ""
    return (f"{type(model).__name__} sets no loss_type, so the stock Trainer divides a padded batch's summed loss "
            "by every label, the first token of each row included (no token predicts it): its loss is lower than "
            "the mean over the real targets by the factor targets/labels; padding-free rows count only the real "
            "targets")


def loss_takes_own_mean(model: nn.Module) -> str:
    """Why the stock Trainer scales this model's loss wrongly ("" where it does not, or where that cannot be told).

    The Trainer reads a ``forward(**kwargs)`` as a loss that takes ``num_items_in_batch`` (the batch's target count
    over every micro-batch and process): it passes the count, skips the division by ``gradient_accumulation_steps``
    and multiplies by the number of processes. Many heads (classification, BERT's masked LM, T5/BART) accept
    ``**kwargs`` but compute their own mean, so their loss and gradients come out ``gradient_accumulation_steps x
    processes`` times too large. Read from transformers' own forward code: only where every loss call in it takes
    neither ``**kwargs`` nor ``num_items_in_batch``; a model that declares ``accepts_loss_kwargs``, or whose forward
    is not transformers' code, is left to the Trainer's rule."""
    import ast
    import inspect
    import textwrap

    cls = type(model)
    if any("accepts_loss_kwargs" in vars(k) for k in cls.__mro__):
        return ""
    forward = inspect.unwrap(getattr(cls, "forward", None) or (lambda: None))
    if not getattr(forward, "__module__", "").startswith("transformers."):
        return ""
    try:
        params = inspect.signature(forward).parameters.values()
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, ValueError, SyntaxError):
        return ""
    if not any(p.kind == p.VAR_KEYWORD for p in params):
        return ""  # the Trainer passes nothing: its own rule is right
    if any(isinstance(n, ast.Name) and n.id == "num_items_in_batch" or
           isinstance(n, ast.Constant) and n.value == "num_items_in_batch" for n in ast.walk(tree)):
        return ""
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and "loss" in _callee(n.func).lower()]
    if not calls or any(k.arg is None or k.arg == "num_items_in_batch" for c in calls for k in c.keywords):
        return ""
    return (f"{cls.__name__}'s loss is its own mean (it takes no num_items_in_batch), so the stock Trainer's "
            "token-count scaling would skip the division by gradient_accumulation_steps and multiply by the number "
            "of processes: its loss and gradients would be that many times too large")


def _callee(func) -> str:
    """The called name: ``self.loss_function`` -> ``loss_function``, ``CrossEntropyLoss`` -> itself."""
    import ast

    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
