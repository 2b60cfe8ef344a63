"""Every preset on every kind of architecture: decoders (dense, sliding-window, softcapped, GPT-2's Conv1D),
mixtures of experts with fused 3-D expert weights, encoders with a masked-LM head, and sequence classifiers.

Tiny configs (hidden 32, 2 layers, vocabulary 64, no dropout), two optimizer steps each. For every cell: the run
works; its losses are the ``baseline`` run's in the same precision (fp32 is pinned: ``auto`` would choose bf16 on a
CPU with AMX); and every ``engaged: true`` of the report is checked on the live objects by this file's own means
(adapters where it says, trainable and trained heads, compiled blocks, checkpointed blocks, the attention kernel,
the chunked loss, padding-free batches, the optimizer). ``fast-compiled`` forces the compile of ``fast`` with the
``eager`` backend (dynamo wiring, no code generation).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import SAME_DTYPE_LOSS_REL

from hf_speedup import SpeedupConfigError, SpeedupTrainer, get_preset
from hf_speedup.blocks import find_blocks, unwrap_model

PRESETS = ("baseline", "auto", "memory", "lora", "fast", "fast-compiled", "long")
ROWS = (9, 13, 16, 11, 7, 15, 12, 10)  # token counts: ragged, so batches pad (and padding-free rows differ)
BATCH = 4
NO_DROPOUT = dict(attention_dropout=0.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64,
             max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
DECODER = dict(SIZES, num_key_value_heads=2, attention_dropout=0.0)


def _config(name: str):
    import transformers as T

    return {
        "llama": lambda: T.LlamaConfig(**DECODER),
        "mistral": lambda: T.MistralConfig(**DECODER, sliding_window=8),
        "qwen3": lambda: T.Qwen3Config(**DECODER, head_dim=8),
        # every layer full attention, logits softcapped: SDPA cannot apply the cap
        "gemma2": lambda: T.Gemma2Config(**DECODER, head_dim=8, layer_types=["full_attention"] * 2),
        "phi3": lambda: T.Phi3Config(**DECODER, resid_pdrop=0.0, embd_pdrop=0.0),
        "gpt2": lambda: T.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=64, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0),
        "opt": lambda: T.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                   vocab_size=64, max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0,
                                   attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "mixtral": lambda: T.MixtralConfig(**DECODER, num_local_experts=4, num_experts_per_tok=2),
        "qwen3_moe": lambda: T.Qwen3MoeConfig(**DECODER, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=32),
        "olmoe": lambda: T.OlmoeConfig(**DECODER, num_experts=4, num_experts_per_tok=2),
        # mixtures of experts whose first block is dense: the experts are in the second block only
        "deepseek_v3": lambda: T.DeepseekV3Config(  # latent attention too: values narrower than queries and keys
            **{**DECODER, "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=4,
            num_experts_per_tok=2, n_group=1, topk_group=1,
            first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
            v_head_dim=8),
        "qwen2_moe": lambda: T.Qwen2MoeConfig(**DECODER, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                              mlp_only_layers=[0]),
        "bert": lambda: T.BertConfig(**SIZES, **NO_DROPOUT),
        "modernbert": lambda: T.ModernBertConfig(**SIZES, cls_token_id=1, sep_token_id=2, attention_dropout=0.0,
                                                 mlp_dropout=0.0, embedding_dropout=0.0),
        "llama_cls": lambda: T.LlamaConfig(**DECODER, num_labels=3),
        "bert_cls": lambda: T.BertConfig(**SIZES, **NO_DROPOUT, num_labels=3),
        "bert_qa": lambda: T.BertConfig(**SIZES, **NO_DROPOUT),
    }[name]()


CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen3": "Qwen3ForCausalLM",
           "gemma2": "Gemma2ForCausalLM", "phi3": "Phi3ForCausalLM", "gpt2": "GPT2LMHeadModel",
           "opt": "OPTForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
           "olmoe": "OlmoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
           "bert": "BertForMaskedLM", "modernbert": "ModernBertForMaskedLM",
           "llama_cls": "LlamaForSequenceClassification", "bert_cls": "BertForSequenceClassification",
           "bert_qa": "BertForQuestionAnswering"}
ARCHS = tuple(CLASSES)
MOE = ("mixtral", "qwen3_moe", "olmoe", "deepseek_v3", "qwen2_moe")
DENSE_FIRST = ("deepseek_v3", "qwen2_moe")  # their first block is dense, the experts are in the second


def build(name: str):
    import transformers

    torch.manual_seed(0)
    return getattr(transformers, CLASSES[name])(_config(name))


def kind(name: str) -> str:
    if name.endswith("_cls"):
        return "classify"
    if name.endswith("_qa"):
        return "answer"
    return "masked" if name in ("bert", "modernbert") else "causal"


def rows(name: str) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i, n in enumerate(ROWS):
        ids = torch.randint(4, 45, (n,), generator=g).tolist()
        row = {"input_ids": ids, "attention_mask": [1] * n}
        if kind(name) == "masked":  # every third token masked (id 3), labels only there
            row["labels"] = [t if j % 3 == 1 else -100 for j, t in enumerate(ids)]
            row["input_ids"] = [3 if j % 3 == 1 else t for j, t in enumerate(ids)]
        elif kind(name) == "classify":
            row["labels"] = i % 3
        elif kind(name) == "answer":  # a span inside the shortest row; the start/end softmax spans the whole row
            row["start_positions"], row["end_positions"] = 1 + i % 3, 3 + i % 4
        out.append(row)
    return out


def collator(name: str, tokenizer):
    from transformers import DataCollatorForLanguageModeling, DataCollatorForSeq2Seq, DataCollatorWithPadding

    return {"causal": lambda: DataCollatorForLanguageModeling(tokenizer, mlm=False),
            "masked": lambda: DataCollatorForSeq2Seq(tokenizer),
            "classify": lambda: DataCollatorWithPadding(tokenizer),
            "answer": lambda: DataCollatorWithPadding(tokenizer)}[kind(name)]()


def speedup(preset: str):
    if preset == "fast-compiled":
        return get_preset("fast").replace(compile={"backend": "eager", "mode": None, "when": "always"})
    if preset == "long":  # tiles of 4 tokens: these rows are 7-16 tokens long, so every MLP runs in several tiles
        return get_preset("long").replace(tiled_mlp={"tile_tokens": 4})
    return preset


@pytest.fixture(scope="module", autouse=True)
def fp32_one_thread():
    """Pin fp32 (a CPU without AMX), so every preset compares with the fp32 baseline on any machine; one thread,
    the fastest for these tiny shapes on a shared 2-core runner (every cell alike, baseline included)."""
    import hf_speedup.hardware as hardware

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hardware, "_cpu_bf16", lambda: (False, "faked for the test: fp32 on every CPU"))
        yield
    torch.set_num_threads(threads)


def run(name: str, preset: str, workdir: str):
    """(trainer, logged losses, the model's weights before training) of one cell."""
    from datasets import Dataset
    from transformers import TrainingArguments

    from hf_speedup.tiny import char_tokenizer

    torch._dynamo.reset()
    tok = char_tokenizer()
    model = build(name)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = TrainingArguments(output_dir=f"{workdir}/{name}-{preset}", per_device_train_batch_size=BATCH, max_steps=2,
                             logging_steps=1, learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no",
                             seed=0, disable_tqdm=True, dataloader_num_workers=0, train_sampling_strategy="sequential")
    trainer = SpeedupTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows(name)),
                             data_collator=collator(name, tok), speedup=speedup(preset))
    trainer.speedup_callback.print_tables = False
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if preset == "baseline":
        BASELINE[name] = losses
    return trainer, losses, before


BASELINE: dict[str, list[float]] = {}  # the baseline cell's losses, for the other presets of its architecture


def baseline_losses(name: str, workdir: str) -> list[float]:
    if name not in BASELINE:  # the baseline cell was deselected or has not run yet
        run(name, "baseline", workdir)
    return BASELINE[name]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("arch"))


def targets_over_labels(batch_rows) -> float:
    """How much lower the stock Trainer's padded GPT-2 loss is than the mean over the real targets (see
    ``test_gpt2_padded_loss_of_the_stock_trainer_is_not_the_token_mean``)."""
    return sum(n - 1 for n in batch_rows) / sum(batch_rows)


# ------------------------------------------------------------------------------------------------ the matrix
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", ARCHS)
def test_preset_on_architecture(name, preset, workdir):
    trainer, losses, before = run(name, preset, workdir)
    base = baseline_losses(name, workdir)
    plan = trainer.speedup_report.to_dict()["plan"]
    assert plan["precision"]["applied"] == "fp32", plan["precision"]  # like with like
    assert len(losses) == len(base) == 2 and all(math.isfinite(x) for x in losses)
    expected = list(base)
    if name == "gpt2" and "padding_free" in plan["data"]["applied"].split(","):
        # the stock Trainer counts every label of GPT-2's padded rows as a target; padding-free rows do not
        expected = [base[0] / targets_over_labels(ROWS[:BATCH])]
    if plan["lora"]["engaged"]:
        expected = base[:1]  # adapters start at zero: the first step is the base model's; then they learn their own
    assert losses[:len(expected)] == pytest.approx(expected, rel=SAME_DTYPE_LOSS_REL["fp32"]), (losses, base)
    engaged = {k for k, v in plan.items() if v["engaged"]}
    unchecked = engaged - set(LIVE_CHECKS) - ARCHITECTURE_INDEPENDENT
    assert not unchecked, f"engaged but not checked on the live objects here: {unchecked}"
    for feature in sorted(engaged & set(LIVE_CHECKS)):
        LIVE_CHECKS[feature](trainer, plan[feature], name, before)


# ------------------------------------------------------------------------------------ the live checks
def _check_lora(trainer, entry, name, before):
    from peft.tuners.lora import LoraLayer, ParamWrapper

    from hf_speedup.features.lora.targets import peft_renamed
    from hf_speedup.model_parts import routers

    model = trainer.model
    base = unwrap_model(model)
    frozen = peft_renamed(base.config.model_type)  # the plan leaves them out and says why (peft's v4 conversion)
    if any(n.split(".")[-1] in frozen for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)):
        assert "stay frozen" in entry["reason"], entry["reason"]
    lora = {n for n, m in model.named_modules() if isinstance(m, LoraLayer)}
    assert sum(entry["settings"]["adapters"].values()) == len(lora)
    for block in find_blocks(model):
        skip = routers(block)
        for n, m in block.named_modules():  # a plain linear layer left is one without an adapter
            in_router = any(n == r or n.startswith(r + ".") for r in skip)
            linear = isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"
            assert not (linear and not in_router and "lora_" not in n and not n.endswith("base_layer")
                        and n.split(".")[-1] not in frozen), f"{n} has no adapter"
        for r in skip:  # the router is frozen and carries no adapter
            router = block.get_submodule(r)
            assert not any(p.requires_grad for p in router.parameters()) and not isinstance(router, LoraLayer)
        wrapped = {f"{n.replace('.base_layer', '')}.{m.parameter_name}" for n, m in block.named_modules()
                   if isinstance(m, ParamWrapper)}
        fused = {n.replace(".base_layer", "") for n, p in block.named_parameters() if p.dim() == 3}
        assert fused == wrapped, (fused, wrapped)  # every expert weight has its adapter
    if name in MOE:
        assert any("experts" in k for k in entry["settings"]["adapters"]), entry
    inside = {id(m) for b in find_blocks(model) for m in b.modules()}
    assert all(id(m) in inside for n, m in model.named_modules() if n in lora), "an adapter outside the blocks"
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert all("lora_" in n or "modules_to_save" in n for n in trainable), trainable
    if kind(name) == "classify":  # the new head trains in full, and the steps changed it
        head = "score" if name == "llama_cls" else "classifier"
        copy = base.get_submodule(head).modules_to_save["default"]
        assert all(p.requires_grad for p in copy.parameters())
        assert not torch.equal(copy.weight, before[f"{head}.weight"]), "the head did not train"
        assert "changed by the first 2 optimizer step(s)" in entry["reason"]


def _check_compile(trainer, entry, name, before):
    blocks = find_blocks(trainer.model)
    regions = [getattr(b, "_compiled_call_impl", None) for b in blocks]
    assert all(r is not None for r in regions), "a block without a compiled call"
    assert all(getattr(r, "calls", 0) > 0 and getattr(r, "fallback_reason", None) is None for r in regions)
    from torch._dynamo.utils import counters

    assert counters["stats"]["unique_graphs"] > 0  # dynamo really produced graphs in this cell


def _check_checkpointing(trainer, entry, name, before):
    """One training forward and backward on the live model: each checkpointed block's layers run twice (counted on
    the first layer with weights inside each block: the block's own hooks sit outside the checkpoint)."""
    model = trainer.model
    blocks = find_blocks(model)
    runs = [0] * len(blocks)
    leaves = [next(m for m in b.modules() if list(m.parameters(recurse=False))) for b in blocks]
    hooks = [leaf.register_forward_pre_hook(lambda m, a, i=i: runs.__setitem__(i, runs[i] + 1))
             for i, leaf in enumerate(leaves)]
    try:
        batch = trainer.data_collator(rows(name)[:2])
        model.train()
        model(**batch).loss.backward()
    finally:
        for h in hooks:
            h.remove()
        model.zero_grad(set_to_none=True)
    assert runs == [2] * len(blocks), runs


def _check_attention(trainer, entry, name, before):
    from transformers import AttentionInterface

    from hf_speedup.features.attention import sdpa_varlen

    config = unwrap_model(trainer.model).config
    assert config._attn_implementation == entry["applied"]
    if entry["applied"] == sdpa_varlen.NAME:
        assert AttentionInterface._global_mapping[sdpa_varlen.NAME] is sdpa_varlen.attention_forward
    if name == "gemma2":  # softcapped logits: never SDPA's math
        assert config._attn_implementation == "eager"


def _check_experts(trainer, entry, name, before):
    """Every experts module dispatches to the planned implementation, read off a forward of the live block."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from hf_speedup.model_parts import experts_modules

    base = unwrap_model(trainer.model)
    modules = experts_modules(base)
    assert name in MOE and modules and {m.config._experts_implementation for _, m in modules} == {entry["applied"]}
    impl, seen = entry["applied"], []
    target = ALL_EXPERTS_FUNCTIONS.get_interface(impl, type(modules[0][1]).forward.__wrapped__)
    ALL_EXPERTS_FUNCTIONS[impl] = lambda self, *a, **k: (seen.append(impl), target(self, *a, **k))[1]
    try:
        with torch.no_grad():
            base(input_ids=torch.tensor([rows(name)[0]["input_ids"]]))
    finally:
        del ALL_EXPERTS_FUNCTIONS[impl]
    assert seen == [impl] * len(modules)  # every block's experts ran it


def _check_loss(trainer, entry, name, before):
    from hf_speedup.features.loss.chunked_cross_entropy import installed_state

    state = installed_state(trainer.model)
    assert state is not None and state.chunked_calls >= 2  # both training steps took the chunked path


def _check_data(trainer, entry, name, before):
    batch = trainer.data_collator(rows(name)[:BATCH])
    if "padding_free" in entry["applied"].split(","):
        assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
        assert batch["position_ids"].tolist()[0].count(0) == BATCH  # each sequence restarts its positions
    pad = entry["settings"].get("pad_to_multiple_of")
    if pad and entry["applied"].startswith("pad="):
        assert batch["input_ids"].shape[1] % pad == 0


def _check_optimizer(trainer, entry, name, before):
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert isinstance(inner, torch.optim.AdamW)
    assert inner.defaults.get("fused") is ("fused" in entry["applied"])


def _check_precision(trainer, entry, name, before):
    assert trainer.accelerator.mixed_precision in ("bf16", "fp16")


def _check_tiled_mlp(trainer, entry, name, before):
    """The recorder of every tiled MLP saw the training steps run it in several tiles; the blocks left untiled are
    the mixture-of-experts ones, named in the report."""
    from hf_speedup.features.tiled_mlp import tiled_mlps
    from hf_speedup.features.tiled_mlp.mechanism import tile_record
    from hf_speedup.model_parts import routers

    blocks = find_blocks(trainer.model)
    tiled = dict(tiled_mlps(trainer.model))
    assert sorted(tiled) == entry["settings"]["blocks"], entry["settings"]
    for i, block in enumerate(blocks):
        assert (i in tiled) == (not routers(block)), (i, name)  # dense MLPs tiled, routed experts not
    for i, mlp in tiled.items():
        record = tile_record(mlp)
        assert record.calls > 0 and record.tiles == -(-record.tokens // 4) > 1 and not record.mismatched, (i, record)
    if entry["settings"]["untiled_blocks"]:
        assert "not tiled (a mixture of experts" in entry["reason"], entry["reason"]


LIVE_CHECKS = {"lora": _check_lora, "compile": _check_compile, "checkpointing": _check_checkpointing,
               "tiled_mlp": _check_tiled_mlp,
               "attention": _check_attention, "experts": _check_experts, "loss": _check_loss, "data": _check_data,
               "optimizer": _check_optimizer, "precision": _check_precision}
# Engaged features whose effect does not depend on the architecture; their own test files check them live.
ARCHITECTURE_INDEPENDENT = {"interrupt", "memory", "empty_cache", "crash_safe"}


# ------------------------------------------------------------------------------------ LoRA on MoE experts
def lora_plan(model, **lora):
    from conftest import CPU_NO_BF16, fake_caps

    from hf_speedup import plan_for

    return plan_for(get_preset("lora").replace(lora=lora) if lora else "lora", caps=fake_caps(**CPU_NO_BF16),
                      model=model)["lora"]


def adapted(model, decision):
    from hf_speedup.features import Setup, lora
    from hf_speedup.plan_types import Outcome

    setup = Setup(model=model, args=None)
    lora.apply(decision, setup, Outcome())
    return setup.model


class _Trainer:  # what verify reads of a trainer
    def __init__(self, model):
        self.model = model


@pytest.mark.parametrize("name", MOE)
def test_lora_on_moe_adapts_the_fused_experts_and_leaves_the_router_frozen(name):
    from hf_speedup.features import lora
    from hf_speedup.plan_types import Outcome

    model = build(name)
    d = lora_plan(model)
    assert d.settings.target_modules == {  # every linear layer the blocks have, experts and routers aside
        "deepseek_v3": ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
        # its shared expert's (and first dense block's) MLP: real linear layers peft leaves alone for this type
        "qwen2_moe": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    }.get(name, ("q_proj", "k_proj", "v_proj", "o_proj"))
    if name == "deepseek_v3":  # peft would turn gate/up/down_proj into the expert weights: said, not silent
        assert "not its down_proj, gate_proj, up_proj layers (dense blocks' MLPs, shared experts)" in d.reason
    assert d.settings.target_parameters == ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    routers = "router mlp.gate, mlp.shared_expert_gate" if name == "qwen2_moe" else "router mlp.gate"
    assert f"{routers} not adapted" in d.reason and "every linear layer" in d.reason and "but its router" in d.reason
    assert d.settings.dropout == 0.0  # peft's ParamWrapper cannot apply dropout: said, not silent
    assert d.fallbacks == ("lora.dropout 0.05 -> 0: peft's lora.ParamWrapper (the adapters on the expert weights) "
                           "cannot apply dropout, and one adapter has one dropout",)
    x = torch.arange(4, 20).unsqueeze(0)
    with torch.no_grad():
        before = model(x).logits
    peft_model = adapted(model, d)
    outcome = Outcome()
    ok, why = lora.verify(d, _Trainer(peft_model), outcome)
    assert ok, why
    moe_blocks = 1 if name in DENSE_FIRST else 2
    assert outcome.facts["adapters"]["model.layers.*.mlp.experts.gate_up_proj"] == moe_blocks
    assert outcome.facts["adapters"]["model.layers.*.mlp.experts.down_proj"] == moe_blocks
    assert f"model.layers.*.mlp.experts.gate_up_proj x{moe_blocks}" in why and "lora.ParamWrapper" in why
    with torch.no_grad():
        torch.testing.assert_close(peft_model(x).logits, before)  # adapters start at zero
    peft_model(x, labels=x).loss.backward()
    experts = [p.grad for n, p in peft_model.named_parameters() if "experts" in n and "lora_B" in n]
    assert len(experts) == 2 * moe_blocks and all(g is not None and g.abs().sum() > 0 for g in experts)


def test_lora_on_moe_refuses_dropout_when_strict():
    with pytest.raises(SpeedupConfigError, match=r"lora\.dropout = 0\.05 cannot apply to the expert weights "
                                                 r"\['mlp\.experts\.gate_up_proj', 'mlp\.experts\.down_proj'\].*"
                                                 r"allowed here: 0\.0; fix: set lora\.dropout: 0"):
        lora_plan(build("mixtral"), strict=True)


def test_an_explicit_target_list_may_name_expert_weights():
    from hf_speedup.features import lora

    model = build("mixtral")
    d = lora_plan(model, target_modules=["q_proj", "experts.down_proj"], dropout=0.0)
    assert (d.settings.target_modules, d.settings.target_parameters) == (("q_proj",), ("experts.down_proj",))
    assert set(lora.adapter_patterns(adapted(model, d))) == {"model.layers.*.self_attn.q_proj",
                                                             "model.layers.*.mlp.experts.down_proj"}
    with pytest.raises(SpeedupConfigError, match=r"\['experts\.up'\] match no Linear layer .* nor expert weight of this "
                                                 r"MixtralForCausalLM; allowed: \[.*'q_proj'.*\] or expert weights "
                                                 r"\['experts\.down_proj', 'experts\.gate_up_proj'\]"):
        adapted(build("mixtral"), lora_plan(build("mixtral"), target_modules=["q_proj", "experts.up"]))


def test_moe_lora_keeps_its_blocks_eager():
    """peft re-registers the expert parametrization at every forward: a compiled block would recompile every step."""
    from conftest import CPU_NO_BF16, fake_caps

    from hf_speedup import plan_for

    d = plan_for(get_preset("fast").replace(lora={"enabled": True, "dropout": 0.0}), caps=fake_caps(**CPU_NO_BF16),
                   model=build("mixtral"))["compile"]
    assert d.applied == "off" and "registers a parametrization at every forward" in d.reason
    assert d.fallbacks and d.fallbacks[0].startswith("compile: LoRA on the experts' fused weights")


@pytest.mark.parametrize("name", MOE)
def test_the_memory_estimate_counts_the_adapters_on_the_experts(name):
    """The plan's adapter count is the live PeftModel's trainable parameters (expert pairs included); the shape
    knows the routed experts per token and their width (the activations depend on them)."""
    from conftest import CPU_NO_BF16, fake_caps

    from hf_speedup.features.memory.budget import training_setup
    from hf_speedup.memory_model import TrainingSetup, estimate, lora_parameters
    from hf_speedup.model_shape import model_shape

    model = build(name)
    shape = model_shape(model)
    assert [n for n, *_ in shape.block_experts] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    d = lora_plan(model)
    setup = training_setup({"lora": d}, shape, fake_caps(**CPU_NO_BF16), micro_batch=1, seq_len=16)
    peft_model = adapted(model, d)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert lora_parameters(shape, setup.lora) == trainable
    assert model_shape(peft_model).block_experts == shape.block_experts  # read through peft's wrapper too
    assert shape.experts_per_token == 2 and shape.expert_intermediate_size == model.config.to_dict().get(
        "moe_intermediate_size", model.config.intermediate_size)
    notes = estimate(shape, TrainingSetup(micro_batch=1, seq_len=16)).notes
    assert "mixture of experts: activations modelled on transformers' expert loop, 2 routed expert(s) per token; " \
           "the router's own tensors are not counted" in notes


# ------------------------------------------------------------------------------------ LoRA and the task head
@pytest.mark.parametrize("head, task, saved", [
    ("BertForSequenceClassification", "SEQ_CLS", ("classifier",)),
    ("BertForTokenClassification", "TOKEN_CLS", ("classifier",)),
    ("BertForQuestionAnswering", "QUESTION_ANS", ("qa_outputs",)),
    ("BertForMaskedLM", None, ()),
    ("LlamaForSequenceClassification", "SEQ_CLS", ("score",)),
    ("LlamaForCausalLM", "CAUSAL_LM", ()),
])
def test_the_peft_task_type_and_the_trained_head_come_from_the_model_head(head, task, saved):
    import transformers

    config = _config("bert" if head.startswith("Bert") else "llama")
    config.num_labels = 3
    torch.manual_seed(0)
    d = lora_plan(getattr(transformers, head)(config))
    assert (d.settings.task_type, d.settings.modules_to_save) == (task, saved)
    if saved:
        assert f"peft task type {task}" in d.reason and "trains in full and is saved with the adapter" in d.reason


def test_a_new_classification_head_trains_and_is_saved_with_the_adapter(workdir, tmp_path):
    from peft import PeftModel

    from hf_speedup.features import lora

    trainer, _, before = run("llama_cls", "lora", workdir)
    copy = trainer.model.base_model.model.score.modules_to_save["default"]
    assert not torch.equal(copy.weight, before["score.weight"])  # the random head learned
    trainer.model.save_pretrained(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(build("llama_cls"), tmp_path / "adapter")
    torch.testing.assert_close(loaded.base_model.model.score.modules_to_save["default"].weight, copy.weight)
    # verify can fail: a head put back to its first weights did not train
    decision, outcome = trainer.speedup_plan["lora"], trainer.speedup_outcomes["lora"]
    with torch.no_grad():
        copy.weight.copy_(before["score.weight"])
    ok, why = lora.verify(decision, trainer, outcome)
    assert not ok and why.endswith("but head 'score' did not change in 2 optimizer step(s)")


def test_encoder_lora_leaves_the_masked_lm_head_alone():
    """BERT's blocks and its MLM head both hold a layer named ``dense``: only the blocks' get adapters."""
    from hf_speedup.features import lora

    model = adapted(build("bert"), lora_plan(build("bert")))
    assert type(model.base_model.model.cls.predictions.transform.dense) is torch.nn.Linear
    assert set(lora.adapter_patterns(model)) == {
        "bert.encoder.layer.*.attention.self.query", "bert.encoder.layer.*.attention.self.key",
        "bert.encoder.layer.*.attention.self.value", "bert.encoder.layer.*.attention.output.dense",
        "bert.encoder.layer.*.intermediate.dense", "bert.encoder.layer.*.output.dense"}


# ------------------------------------------------------------------------------------ GPT-2's padded loss
def test_gpt2_padded_loss_of_the_stock_trainer_is_not_the_token_mean(workdir):
    """GPT2LMHeadModel sets no loss_type, so the stock Trainer counts every label of a padded batch as a target,
    the first token of each row included. The mean cross-entropy over the real targets, computed here by hand,
    is what padding-free rows give; the stock padded figure is lower by targets/labels."""
    import torch.nn.functional as F
    from datasets import Dataset
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from hf_speedup.tiny import char_tokenizer

    batch = rows("gpt2")[:BATCH]
    model = build("gpt2")
    with torch.no_grad():
        total = sum(F.cross_entropy(model(torch.tensor([r["input_ids"]])).logits[0, :-1],
                                    torch.tensor(r["input_ids"][1:]), reduction="sum") for r in batch)
    labels, targets = sum(ROWS[:BATCH]), sum(n - 1 for n in ROWS[:BATCH])  # 49 labels, 45 targets
    token_mean = (total / targets).item()

    def first_loss(trainer_cls, **kw):
        args = TrainingArguments(output_dir=f"{workdir}/gpt2-{trainer_cls.__name__}", per_device_train_batch_size=BATCH,
                                 max_steps=1, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                                 disable_tqdm=True, dataloader_num_workers=0)
        trainer = trainer_cls(model=build("gpt2"), args=args, train_dataset=Dataset.from_list(batch),
                              data_collator=DataCollatorForLanguageModeling(char_tokenizer(), mlm=False), **kw)
        trainer.train()
        return trainer, next(h["loss"] for h in trainer.state.log_history if "loss" in h)

    _, stock = first_loss(Trainer)
    assert stock == pytest.approx(token_mean * targets / labels, rel=1e-5)  # 8% low here
    ours, padding_free = first_loss(SpeedupTrainer, speedup=get_preset("auto").replace(precision={"dtype": "fp32"}))
    assert padding_free == pytest.approx(token_mean, rel=1e-5)
    data = ours.speedup_report.to_dict()["plan"]["data"]
    assert "padding_free" in data["applied"].split(",")
    assert "GPT2LMHeadModel sets no loss_type, so the stock Trainer divides a padded batch's summed loss" in data["reason"]
