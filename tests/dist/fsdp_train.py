"""A real FSDP run on CPU processes (gloo), driven by tests/test_fsdp_distributed.py.

    torchrun --standalone --nproc_per_node 2 tests/dist/fsdp_train.py --out DIR [--phases main,resume,...]
    accelerate launch --multi_gpu --num_processes 2 tests/dist/fsdp_train.py --out DIR --phases main
    accelerate launch --config_file configs/accelerate/fsdp2_full_shard.yaml --num_processes 2 \
        tests/dist/fsdp_train.py --out DIR --phases main
    torchrun --standalone --nproc_per_node 1 tests/dist/fsdp_train.py --out DIR --phases main --cuda  # NCCL

Every rank writes ``DIR/rank<R>.json`` with what it saw on the live objects; the test compares the ranks
with each other and with a single-process reference (:func:`reference_losses`: same data, same global batch).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from dist_common import GLOBAL_BATCH, MODEL, this_rank, world_size  # first: this checkout importable, the environment

STEPS = 8
SAVE_AT = 4
LR = 1e-3
PHASES = ("main", "resume", "lora", "moe_lora", "offload", "full", "strategies", "trap")
CUDA = False  # --cuda: train on the GPUs (NCCL), as the GPU plan does with one process


def build(seed: int = 0):
    from hf_speedup.tiny import tiny_llama

    return tiny_llama(seed=seed, **MODEL)


def data():
    from hf_speedup.tiny import char_tokenizer, make_rows

    tok = char_tokenizer()
    return tok, make_rows(tok, n=256, seed=0, pack_to=64)  # a list where `datasets` is missing (the GPU image)


def make_args(out, per_device: int, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=str(out), per_device_train_batch_size=per_device, max_steps=STEPS, learning_rate=LR,
                logging_steps=1, report_to=[], use_cpu=not CUDA, save_strategy="steps", save_steps=SAVE_AT, seed=0,
                dataloader_num_workers=0, disable_tqdm=True, dataloader_drop_last=True)
    base.update(kw)
    return TrainingArguments(**base)


def trainer_for(model, args, speedup, tok, ds):
    from hf_speedup import SpeedupTrainer
    from hf_speedup.tiny import causal_lm_collator

    return SpeedupTrainer(model=model, args=args, train_dataset=ds, data_collator=causal_lm_collator(tok),
                          processing_class=tok, speedup=speedup)


def losses(trainer) -> dict[int, float]:
    return {int(h["step"]): float(h["loss"]) for h in trainer.state.log_history if "loss" in h}


def reference_losses(out, speedup="fsdp") -> tuple[dict[int, float], dict, str]:
    """One process, the whole global batch: what the sharded run must reproduce (losses, the FSDP entry, the
    compute dtype)."""
    tok, ds = data()
    tr = trainer_for(build(0), make_args(out, GLOBAL_BATCH, save_strategy="no"), speedup, tok, ds)
    tr.train()
    return losses(tr), tr.speedup_status["fsdp"].to_dict(), tr.speedup_status["precision"].settings.name


def _facts(trainer) -> dict:
    from torch.distributed.tensor import DTensor

    from hf_speedup.features.fsdp.summary import sharding_summary

    model = trainer.model
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    w = getattr(emb, "weight", None)
    import torch.distributed as dist

    return {
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "parameter_devices": sorted({str(p.device) for p in model.parameters()}),
        "summary": sharding_summary(model),
        "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "trainable_dtensor": all(isinstance(p, DTensor) for p in model.parameters() if p.requires_grad),
        "model_class": type(model).__name__,
        "wrapped_class": type(trainer.model_wrapped).__name__,
        "embed_local_shape": list(w.to_local().shape) if isinstance(w, DTensor) else None,
        "embed_global_shape": list(w.shape) if w is not None else None,
        "embed_placements": str(tuple(w.placements)) if isinstance(w, DTensor) else None,
        "decision": trainer.speedup_status["fsdp"].to_dict(),
        "checkpointing": trainer.speedup_status["checkpointing"].to_dict(),
        "lora": trainer.speedup_status["lora"].to_dict(),
        "compute_dtype": trainer.speedup_status["precision"].settings.name,  # "bf16" on AMX CPUs, else "fp32"
        "precision_reason": trainer.speedup_status["precision"].decision.reason,
    }


def phase_main(out: Path, rank: int, res: dict) -> None:
    import torch

    tok, ds = data()
    # each rank initialises differently: the run can only match the reference if rank 0's weights are broadcast
    tr = trainer_for(build(seed=rank), make_args(out / "main", GLOBAL_BATCH // world_size()), "fsdp", tok, ds)
    state = tr.speedup_status["fsdp"]
    res["main_init"] = {"engaged": state.engaged, "reason": state.engaged_reason}
    tr.train()
    res["main"] = {"losses": losses(tr), **_facts(tr)}
    ck = out / "main" / f"checkpoint-{SAVE_AT}"
    res["main"]["checkpoint_files"] = sorted(os.listdir(ck)) if ck.is_dir() else []
    shard_dir = ck / "pytorch_model_fsdp_0"
    res["main"]["model_shard_files"] = sorted(os.listdir(shard_dir)) if shard_dir.is_dir() else []

    # the final save is a full, loadable HF model (rank 0 writes it; every rank joins the gather)
    from hf_speedup.tiny import causal_lm_collator

    batch = causal_lm_collator(tok)([ds[i] for i in range(GLOBAL_BATCH)])
    tr.save_model(str(out / "final"))
    tr.model.eval()
    with torch.no_grad():
        res["main"]["final_loss_sharded"] = float(tr.model(**{k: v.to(tr.args.device) for k, v in batch.items()}).loss)
    if rank == 0:
        from transformers import LlamaForCausalLM

        saved = LlamaForCausalLM.from_pretrained(str(out / "final"))
        with torch.no_grad():
            res["main"]["final_loss_saved"] = float(saved(**batch).loss)
        res["main"]["saved_parameters"] = sum(p.numel() for p in saved.parameters())


def phase_resume(out: Path, rank: int, res: dict) -> None:
    tok, ds = data()
    # another seed: every weight the resumed run trains with must come from the checkpoint
    tr = trainer_for(build(seed=1), make_args(out / "resume", GLOBAL_BATCH // world_size()), "fsdp", tok, ds)
    tr.train(resume_from_checkpoint=str(out / "main" / f"checkpoint-{SAVE_AT}"))
    res["resume"] = {"losses": losses(tr), "engaged": tr.speedup_status["fsdp"].engaged}


def phase_lora(out: Path, rank: int, res: dict) -> None:
    from hf_speedup.features.fsdp.checkpoint import full_model_state_dict

    tok, ds = data()
    tr = trainer_for(build(0), make_args(out / "lora", GLOBAL_BATCH // world_size(), max_steps=4, save_strategy="no"),
                     "fsdp-lora", tok, ds)
    before = {k: v.clone() for k, v in full_model_state_dict(tr.model).items()}
    tr.train()
    after = full_model_state_dict(tr.model)
    info = {"losses": losses(tr), **_facts(tr)}
    if rank == 0:
        changed = sorted(k for k in before if not before[k].equal(after[k]))
        info["changed_lora"] = sum("lora_" in k for k in changed)
        info["changed_base"] = [k for k in changed if "lora_" not in k]
        info["lora_tensors"] = sum("lora_" in k for k in before)
    tr.save_model(str(out / "lora_final"))
    info["saved_files"] = sorted(os.listdir(out / "lora_final")) if rank == 0 else []
    res["lora"] = info


def build_moe(seed: int = 0):
    """A tiny Mixtral: experts as fused 3-D parameters (transformers 5), adapted through peft's target_parameters."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    from hf_speedup.tiny import char_tokenizer

    torch.manual_seed(seed)
    cfg = MixtralConfig(**MODEL, num_hidden_layers=2, vocab_size=len(char_tokenizer()), num_local_experts=4,
                        num_experts_per_tok=2, max_position_embeddings=128, attention_dropout=0.0)
    return MixtralForCausalLM(cfg)


def phase_moe_lora(out: Path, rank: int, res: dict) -> None:
    """fsdp-lora on a mixture of experts: the expert adapters (peft's ParamWrapper) shard and train, the base does not."""
    from hf_speedup.features.fsdp.checkpoint import full_model_state_dict

    tok, ds = data()
    tr = trainer_for(build_moe(0), make_args(out / "moe_lora", GLOBAL_BATCH // world_size(), max_steps=3,
                                             save_strategy="no"),
                     {"base": "fsdp-lora", "lora": {"dropout": 0.0}}, tok, ds)
    before = {k: v.clone() for k, v in full_model_state_dict(tr.model).items()}
    tr.train()
    after = full_model_state_dict(tr.model)
    info = {"losses": losses(tr), **_facts(tr), "adapters": tr.speedup_status["lora"].facts.get("adapters")}
    if rank == 0:
        changed = sorted(k for k in before if not before[k].equal(after[k]))
        info["changed_expert_lora"] = sorted(k for k in changed if "lora_" in k and "experts" in k)
        info["changed_base"] = [k for k in changed if "lora_" not in k]
    res["moe_lora"] = info


def phase_offload(out: Path, rank: int, res: dict) -> None:
    tok, ds = data()
    tr = trainer_for(build(0), make_args(out / "offload", GLOBAL_BATCH // world_size(), max_steps=3,
                                         save_strategy="no"), "fsdp-offload", tok, ds)
    tr.train()
    res["offload"] = {"losses": losses(tr), **_facts(tr)}


def phase_full(out: Path, rank: int, res: dict) -> None:
    from hf_speedup import get_preset

    tok, ds = data()
    cfg = get_preset("fsdp").replace(fsdp={"state_dict_type": "full"})
    tr = trainer_for(build(0), make_args(out / "full", GLOBAL_BATCH // world_size(), max_steps=4, save_steps=2), cfg,
                     tok, ds)
    tr.train()
    ck = out / "full" / "checkpoint-2"
    info = {"losses": losses(tr), "checkpoint_files": sorted(os.listdir(ck)) if ck.is_dir() else []}
    tr2 = trainer_for(build(seed=1), make_args(out / "full_resume", GLOBAL_BATCH // world_size(), max_steps=4,
                                               save_strategy="no"), cfg, tok, ds)
    tr2.train(resume_from_checkpoint=str(ck))
    info["resume_losses"] = losses(tr2)
    res["full"] = info


def phase_strategies(out: Path, rank: int, res: dict) -> None:
    from hf_speedup import get_preset

    tok, ds = data()
    res["strategies"] = {}
    for strategy in ("shard_grad_op", "no_shard", "hybrid_shard"):
        cfg = get_preset("fsdp").replace(fsdp={"strategy": strategy})
        tr = trainer_for(build(0), make_args(out / strategy, GLOBAL_BATCH // world_size(), max_steps=2,
                                             save_strategy="no"), cfg, tok, ds)
        tr.train()
        res["strategies"][strategy] = {"losses": losses(tr), **_facts(tr)}
    # tied input/output embeddings: one weight, so one unit (the root) owns it
    import torch
    from transformers import LlamaForCausalLM

    from hf_speedup.tiny import tiny_llama_config

    config = tiny_llama_config(**MODEL)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    tied = LlamaForCausalLM(config)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    tr = trainer_for(tied, make_args(out / "tied", GLOBAL_BATCH // world_size(), max_steps=2, save_strategy="no"),
                     "fsdp", tok, ds)
    tr.train()
    res["strategies"]["tied"] = {"losses": losses(tr), "still_tied": tr.model.lm_head.weight is
                                 tr.model.model.embed_tokens.weight, **_facts(tr)}
    # gradient accumulation: 2 micro-batches of 2 per rank = the same global batch of 8
    tr = trainer_for(build(0), make_args(out / "ga", 2, gradient_accumulation_steps=2, max_steps=3,
                                         save_strategy="no"), "fsdp", tok, ds)
    tr.train()
    ev = tr.evaluate(eval_dataset=ds.select(range(16)))  # evaluation on the sharded model
    res["strategies"]["ga"] = {"losses": losses(tr), "eval_loss": ev["eval_loss"], **_facts(tr)}
    # bf16 (forced; slow on a CPU without AMX): FSDP2 casts the all-gathered parameters, reduces in fp32
    cfg = get_preset("fsdp").replace(precision={"dtype": "bf16"})
    tr = trainer_for(build(0), make_args(out / "bf16", GLOBAL_BATCH // world_size(), max_steps=3, save_strategy="no"),
                     cfg, tok, ds)
    tr.train()
    res["strategies"]["bf16"] = {"losses": losses(tr), "precision": tr.speedup_status["precision"].to_dict(),
                                 **_facts(tr)}


def phase_compile(out: Path, rank: int, res: dict) -> None:
    """Regional compile (inductor, in place) then FSDP2: compiled blocks under fully_shard (slow: not in PHASES)."""
    from hf_speedup import get_preset

    tok, ds = data()
    cfg = get_preset("fsdp").replace(compile={"enabled": True, "backend": "inductor"})
    tr = trainer_for(build(0), make_args(out / "compile", GLOBAL_BATCH // world_size(), max_steps=4,
                                         save_strategy="no"), cfg, tok, ds)
    tr.train()
    res["compile"] = {"losses": losses(tr), "compile": tr.speedup_status["compile"].to_dict(), **_facts(tr)}


def phase_trap(out: Path, rank: int, res: dict) -> None:
    """The measured trap: the stock Trainer's FSDP on CPU trains with DDP; hf_speedup says so and can shard."""
    import torch
    from transformers import Trainer

    from hf_speedup.config import SpeedupConfigError
    from hf_speedup.tiny import causal_lm_collator

    tok, ds = data()
    fsdp_args = dict(fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    args = make_args(out / "trap", GLOBAL_BATCH // world_size(), max_steps=1, save_strategy="no", **fsdp_args)
    stock = Trainer(model=build(0), args=args, train_dataset=ds, data_collator=causal_lm_collator(tok))
    stock.train()
    info = {"stock_wrapped": type(stock.model_wrapped).__name__, "stock_fsdp_enabled": stock.is_fsdp_enabled}
    tr = trainer_for(build(0), args, "auto", tok, ds)  # fsdp not requested by hf_speedup: reported, not hidden
    info["auto_fsdp"] = tr.speedup_status["fsdp"].to_dict()
    # a built optimizer holds the unsharded parameters: refused, with the fix
    from hf_speedup import SpeedupTrainer

    model = build(0)
    stale = SpeedupTrainer(model=model, args=make_args(out / "stale", GLOBAL_BATCH // world_size(), max_steps=1,
                                                       save_strategy="no"),
                           train_dataset=ds, data_collator=causal_lm_collator(tok), speedup="fsdp",
                           optimizers=(torch.optim.AdamW(model.parameters(), lr=LR), None))
    try:
        stale.train()
        info["stale_optimizer_error"] = None
    except SpeedupConfigError as exc:
        info["stale_optimizer_error"] = str(exc)
    # a forward before train() (evaluate, a user's check) leaves the head and root units unsharded: still trains
    early = trainer_for(build(0), make_args(out / "early", GLOBAL_BATCH // world_size(), max_steps=1,
                                            save_strategy="no"), "fsdp", tok, ds)
    with torch.no_grad():
        early.model(**causal_lm_collator(tok)([ds[i] for i in range(2)]))
    try:
        early.train()
        info["forward_before_train"] = {"losses": losses(early), "error": None}
    except SpeedupConfigError as exc:
        info["forward_before_train"] = {"losses": {}, "error": str(exc)}
    res["trap"] = info


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--cuda", action="store_true", help="train on the GPUs (NCCL) instead of CPU processes")
    ns = p.parse_args(argv)
    global CUDA
    CUDA = ns.cuda
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    rank = this_rank()
    res: dict = {"rank": rank, "world_size": world_size()}
    for name in ns.phases.split(","):
        globals()[f"phase_{name}"](out, rank, res)
        (out / f"rank{rank}.json").write_text(json.dumps(res, indent=1, default=str))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # results are on disk and the group is destroyed: skip interpreter teardown, where torch's gloo backend
    # can still abort a finished process now and then (SIGABRT, "terminate called without an active exception")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
