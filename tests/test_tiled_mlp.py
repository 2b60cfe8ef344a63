"""The sequence-tiled MLP and the long preset on one process: the tile rule and its statement in the plan, exact
gradients (full and LoRA, with and without checkpointed blocks), intermediates that never span the sequence,
one gradient accumulation per weight, the recorder, and what is not tiled (experts, encoders) said so."""

from __future__ import annotations

import pytest
import torch
from conftest import CPU_NO_BF16, CUDA_H100, fake_caps

from hf_speedup import SpeedupConfigError, SpeedupTrainer, get_preset, plan_for
from hf_speedup.blocks import find_blocks
from hf_speedup.features.checkpointing.mechanism import enable_block_checkpointing
from hf_speedup.features.tiled_mlp import tiled_mlps
from hf_speedup.features.tiled_mlp.mechanism import TileRule, mlp_of, tile_mlp, tile_record
from hf_speedup.tiny import tiny_llama


def _model(seed=0, checkpointed=True, tile=None, **kw):
    torch.manual_seed(seed)
    model = tiny_llama(seed=seed, **kw)
    model.train()
    model.config.use_cache = False
    blocks = find_blocks(model)
    if checkpointed:
        enable_block_checkpointing(blocks, range(len(blocks)), {"use_reentrant": False})
    if tile is not None:
        for b in blocks:
            tile_mlp(mlp_of(b)[1], TileRule(tile_tokens=tile))
    return model


def _grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------- the rule and the plan
def test_tile_rule_counts():
    assert TileRule(tile_tokens=4).tiles(9) == 3 and TileRule(tile_tokens=4).tile_length(9) == 3
    auto = TileRule(min_tile_tokens=1024, max_tiles=16)
    assert [auto.tiles(n) for n in (100, 1024, 4096, 65536, 10**6)] == [1, 1, 4, 16, 16]
    assert auto.tile_length(65536) == 4096
    assert TileRule(fixed_tiles=5).tiles(3) == 5  # ZeRO-3: as many tiles at every length
    x = torch.zeros(1, 3, 2)
    assert [c.shape[-2] for c in TileRule(fixed_tiles=5).split(x)] == [1, 1, 1, 0, 0]


def test_the_plan_states_the_tile_count_and_its_figure_at_the_planned_length():
    model = tiny_llama()  # hidden 256, MLP width 688: at most ceil(6 x 688 / 256) = 17 tiles
    cfg = get_preset("long").replace(memory={"seq_len": 65536})
    d = plan_for(cfg, caps=fake_caps(**CPU_NO_BF16), model=model)["tiled_mlp"]
    assert d.applied == "tiled" and d.settings.max_tiles == 17 and d.settings.tiles == 17
    assert d.settings.tile_tokens == -(-65536 // 17)
    assert "at 65536 tokens (memory.seq_len): 17 tile(s) of 3856 tokens" in d.reason, d.reason
    assert "the MLP working set 60.72 MiB instead of 1.01 GiB" in d.reason, d.reason
    short = plan_for(get_preset("long").replace(memory={"seq_len": 1500}), caps=fake_caps(**CPU_NO_BF16),
                     model=model)["tiled_mlp"]
    assert short.settings.tiles == 1  # tiles of at least 1024 tokens: 1,500 stays whole


def test_off_by_default_and_in_every_other_preset():
    for name in ("baseline", "auto", "fast", "memory", "lora"):
        assert plan_for(name, caps=fake_caps(**CPU_NO_BF16), model=tiny_llama())["tiled_mlp"].applied == "off"


def test_auto_stays_off_beside_compiled_blocks_and_true_tiles_anyway():
    cfg = get_preset("fast").replace(tiled_mlp={"enabled": "auto"}, compile={"when": "always"})
    d = plan_for(cfg, caps=fake_caps(**CUDA_H100), model=tiny_llama())["tiled_mlp"]
    assert d.applied == "off" and "beside compiled blocks" in d.reason
    d = plan_for(cfg.replace(tiled_mlp={"enabled": True}), caps=fake_caps(**CUDA_H100), model=tiny_llama())["tiled_mlp"]
    assert d.applied == "tiled" and "graph break" in d.reason


@pytest.mark.parametrize("value", [0, -3, "8", 2.5, True])
def test_a_bad_tile_size_is_refused_naming_the_field(value):
    with pytest.raises(SpeedupConfigError, match=r"tiled_mlp.tile_tokens = .* is not allowed; allowed: 'auto' or an "
                                                 r"integer >= 1 \(tokens per tile\); fix: e.g. tiled_mlp.tile_tokens: auto"):
        get_preset("long").replace(tiled_mlp={"tile_tokens": value}).validate()


# ---------------------------------------------------------------------------------------- exact, and lean
@pytest.mark.parametrize("checkpointed", [True, False])
def test_tiled_gradients_equal_the_whole_mlp_ones(checkpointed):
    ids = torch.randint(0, 512, (2, 45))
    loss_ref, ref = _grads(_model(checkpointed=checkpointed), ids)
    loss, got = _grads(_model(checkpointed=checkpointed, tile=8), ids)
    assert torch.allclose(loss, loss_ref, rtol=1e-6)
    assert set(got) == set(ref)
    worst = max(_rel(got[n], ref[n]) for n in ref)
    assert worst <= 1e-5, worst


def test_lora_gradients_equal_the_whole_mlp_ones():
    from peft import LoraConfig, get_peft_model

    ids = torch.randint(0, 512, (1, 40))
    results = []
    for tile in (None, 8):
        torch.manual_seed(0)
        model = get_peft_model(tiny_llama(seed=0), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                                              target_modules=["gate_proj", "up_proj", "down_proj"]))
        model.train()
        blocks = find_blocks(model)
        enable_block_checkpointing(blocks, range(len(blocks)), {"use_reentrant": False})
        if tile:
            for b in blocks:
                tile_mlp(mlp_of(b)[1], TileRule(tile_tokens=tile))
        results.append(_grads(model, ids)[1])
    ref, got = results
    assert ref and all("lora_" in n for n in ref)
    assert max(_rel(got[n], ref[n]) for n in ref) <= 1e-5


def test_the_mlp_intermediates_never_span_the_whole_sequence():
    """The widest tensors (gate and up: tokens x MLP width) exist for one tile at a time, in the forward and in the
    recomputes of backward; untiled they span all 48 tokens."""
    for tile, widest in ((None, 48), (8, 8)):
        model = _model(tile=tile)
        seen = []
        for b in find_blocks(model):
            b.mlp.act_fn.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[-2]))
        _grads(model, torch.randint(0, 512, (1, 48)))
        assert max(seen) == widest, (tile, seen)
        # 4 blocks, each MLP run in the forward and once more in backward: whole, in the block's recompute; tiled,
        # each of the 6 tiles alone (the block's recompute stops before its MLP: no third run)
        assert len(seen) == 4 * 2 * (1 if tile is None else 6), (tile, len(seen))


def test_each_weight_accumulates_its_gradient_once_per_backward():
    """The hook DDP, FSDP2 and ZeRO hang their reduction on runs once per weight and backward, tiles or not."""
    model = _model(tile=8)
    calls: dict[str, int] = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    _grads(model, torch.randint(0, 512, (1, 40)))
    assert calls and set(calls.values()) == {1}, calls


# ---------------------------------------------------------------------------------------- the trainer
def _trainer(tmp_path, dataset, collator, model=None, **sections):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=2,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0)
    cfg = get_preset("long").replace(precision={"dtype": "fp32"}, **sections)
    return SpeedupTrainer(model=model if model is not None else tiny_llama(), args=args, train_dataset=dataset,
                          data_collator=collator, speedup=cfg)


def test_long_trains_and_the_recorder_sees_the_planned_tiles(tmp_path, dataset, collator):
    trainer = _trainer(tmp_path, dataset, collator, tiled_mlp={"tile_tokens": 8})
    entry = trainer.speedup_report.to_dict()["plan"]["tiled_mlp"]
    assert entry["engaged"] is True
    assert "a probe ran 9 tokens in 3 tiles, output and input gradient equal to the untiled MLP's" in entry["reason"]
    trainer.train()
    entry = trainer.speedup_report.to_dict()["plan"]["tiled_mlp"]
    seen = entry["settings"]["seen"]
    assert entry["engaged"] is True and seen["mlps_run"] == 4, entry
    assert seen["tiles"] == -(-seen["tokens"] // 8) > 1, seen  # the training batches, not a probe's 8 or 9 tokens
    plan = trainer.speedup_report.to_dict()["plan"]
    assert plan["checkpointing"]["engaged"] and plan["loss"]["applied"].startswith("chunked")
    assert "padding_free" in plan["data"]["applied"]


def test_the_first_loss_is_the_memory_presets(tmp_path, dataset, collator):
    """Same precision, same rows: long and memory start from the same loss (tiling changes no math)."""
    from transformers import TrainingArguments

    losses = []
    for preset in ("memory", "long"):
        args = TrainingArguments(output_dir=str(tmp_path / preset), per_device_train_batch_size=4, max_steps=1,
                                 logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                                 seed=0)
        cfg = get_preset(preset).replace(precision={"dtype": "fp32"}, data={"padding_free": True},
                                         tiled_mlp={"tile_tokens": 8})
        trainer = SpeedupTrainer(model=tiny_llama(), args=args, train_dataset=dataset, data_collator=collator,
                                 speedup=cfg)
        trainer.train()
        losses.append([h["loss"] for h in trainer.state.log_history if "loss" in h][0])
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


def test_a_verifier_sees_an_mlp_that_no_longer_tiles(tmp_path, dataset, collator):
    from hf_speedup.features.tiled_mlp.mechanism import untile_mlp

    trainer = _trainer(tmp_path, dataset, collator, tiled_mlp={"tile_tokens": 8})
    for _, mlp in tiled_mlps(trainer.model):
        untile_mlp(mlp)
    trainer.verify_speedup()
    entry = trainer.speedup_status["tiled_mlp"]
    assert entry.engaged is False and "no MLP is set up to run tiled" in entry.engaged_reason


def test_an_encoder_is_not_tiled_and_says_why(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    model = BertForMaskedLM(BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, vocab_size=64))
    d = plan_for("long", caps=fake_caps(**CPU_NO_BF16), model=model)
    from hf_speedup.features import Setup, tiled_mlp
    from hf_speedup.plan_types import Outcome

    outcome = Outcome()
    tiled_mlp.apply(d["tiled_mlp"], Setup(model=model, args=None), outcome)
    assert outcome.withdrawn and "no block has a dense MLP that takes the hidden states alone" in outcome.withdrawn


def test_mixture_of_experts_blocks_keep_their_experts_untiled():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=32, shared_expert_intermediate_size=32, mlp_only_layers=[0])
    model = Qwen2MoeForCausalLM(cfg)
    d = plan_for("long", caps=fake_caps(**CPU_NO_BF16), model=model)["tiled_mlp"]
    assert "mixture-of-experts blocks keep their experts untiled" in d.reason
    from hf_speedup.features import Setup, tiled_mlp
    from hf_speedup.plan_types import Outcome

    outcome = Outcome()
    tiled_mlp.apply(d, Setup(model=model, args=None), outcome)
    assert outcome.facts["blocks"] == [0] and outcome.facts["untiled_blocks"] == [1]
    assert tile_record(find_blocks(model)[0].mlp) is not None and tile_record(find_blocks(model)[1].mlp) is None
