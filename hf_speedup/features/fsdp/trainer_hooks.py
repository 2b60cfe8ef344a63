"""The Trainer methods hf_speedup's FSDP changes; ``SpeedupTrainer`` mixes them in."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ... import compat
from ...config import SpeedupConfigError
from .checkpoint import (
    FULL_MODEL_FILE,
    FULL_OPTIMIZER_FILE,
    SCHEDULER_FILE,
    full_model_state_dict,
    full_optimizer_state_dict,
    holds_fsdp_state,
    load_model_checkpoint,
    load_optimizer_checkpoint,
    save_sharded_model,
    save_sharded_optimizer,
    shard_count,
)
from .launcher import parallelism_kept_from_accelerate
from .settings import LAUNCH_CONFIG, NAME, plugin_overrides
from .shard import ShardSpec, shard_model

logger = logging.getLogger("hf_speedup")


class FsdpTrainerMixin:
    """The Trainer methods hf_speedup's FSDP needs; each is a pass-through unless the plan says otherwise.

    ``backend == "hf_speedup"`` (CPU): shard right after the Accelerator exists (by then every feature's
    ``apply`` has run: LoRA wrapped, checkpointing and regional compile set up, so the order is
    torchtitan's: adapters -> activation checkpointing -> compile -> FSDP), let accelerate add autocast
    only (as transformers does for a model sharded at load time) and mark the model prepared so that
    neither ``.to()`` nor DDP touches it; save/load checkpoints with torch.distributed.checkpoint.

    ``backend == "accelerate"`` (CUDA): the plugin gets what ``fsdp_config`` cannot carry (FSDP1 strategy,
    explicit CPU offload, mixed precision reducing gradients in fp32), and a final
    ``save_model()`` under a sharded state-dict type still writes a full, loadable model.
    """

    def _speedup_fsdp(self) -> tuple[str | None, Any]:
        plan = getattr(self, "speedup_plan", None)
        decision = plan.decisions.get(NAME) if plan is not None else None
        if decision is None or not decision.active:
            return None, decision
        return decision.settings.backend, decision

    def _speedup_fsdp_note(self, note: str, level: int) -> None:
        """Logged, and added to the fsdp entry's reason in the report."""
        logger.log(level, "hf_speedup fsdp: %s", note)
        outcome = (getattr(self, "speedup_outcomes", None) or {}).get(NAME)
        if outcome is not None:
            outcome.notes.append(note)

    # -- setup -----------------------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        backend, decision = self._speedup_fsdp()
        if backend == "accelerate":
            self._speedup_fsdp_plugin_args(decision)
        if backend != "hf_speedup":
            super().create_accelerator_and_postprocess()
            self._speedup_accelerate_dynamo_off()
            return
        with parallelism_kept_from_accelerate() as kept:  # accelerate refuses a ParallelismConfig on CPU processes
            super().create_accelerator_and_postprocess()
        if kept:
            mesh = decision.settings.mesh
            dims = " x ".join(f"{n}={s}" for n, s in zip(mesh.dim_names, mesh.shape))
            note = (f"the accelerate launch config's parallelism_config is applied by hf_speedup's FSDP2 (mesh "
                    f"{dims}); it was kept from accelerate's Accelerator, which refuses it on CPU processes (MULTI_CPU)")
            self._speedup_fsdp_note(note, logging.INFO)
        self._speedup_accelerate_dynamo_off()
        self._speedup_fsdp_shard(decision)

    def _speedup_accelerate_dynamo_off(self) -> None:
        """Keep accelerate from compiling what hf_speedup compiled: with its compile decision active the blocks
        are already compiled in place (guarded regions); accelerate's ``prepare`` would compile again from the
        launch YAML's ``dynamo_config`` (regional: every block, replacing the guarded regions; FSDP or not).
        Turned off, logged and added to the compile feature's reason."""
        plan = getattr(self, "speedup_plan", None)
        compile_decision = plan.decisions.get("compile") if plan is not None else None
        if compile_decision is None or not compile_decision.active:
            return
        dynamo = getattr(getattr(getattr(self, "accelerator", None), "state", None), "dynamo_plugin", None)
        backend = getattr(dynamo, "backend", None)
        name = str(getattr(backend, "value", backend)).upper()
        if backend is None or name == "NO":
            return
        from accelerate.utils import DynamoBackend

        dynamo.backend = DynamoBackend.NO
        how = "regional" if getattr(dynamo, "use_regional_compilation", False) else "whole model"
        note = (f"accelerate's dynamo_config ({name}, {how}) turned off: hf_speedup already compiled the blocks, and "
                "accelerate's prepare would compile them again over hf_speedup's guarded regions")
        logger.warning("hf_speedup compile: %s", note)
        outcome = (getattr(self, "speedup_outcomes", None) or {}).get("compile")
        if outcome is not None:
            outcome.notes.append(note)

    def _speedup_fsdp_plugin_args(self, decision) -> None:
        """What ``fsdp_config`` cannot carry (``settings.plugin_overrides``): the FSDP1 sharding strategy and an
        explicit ``cpu_offload`` replace anything accelerate would read from the launch environment; a mixed
        precision policy the caller put there is kept."""
        plugin_args = getattr(self.args, "fsdp_plugin_args", None)
        if not isinstance(plugin_args, dict):
            return
        if plugin_args.get("fsdp_version") != decision.settings.version:
            logger.warning("hf_speedup fsdp: TrainingArguments ask for FSDP%s, the plan for FSDP%s; the plan's "
                           "strategy, offload and mixed precision are not added to accelerate's plugin",
                           plugin_args.get("fsdp_version"), decision.settings.version)
            return
        for key, value in plugin_overrides(decision.settings).items():
            if key == "mixed_precision_policy":
                plugin_args.setdefault(key, value)
            else:
                plugin_args[key] = value

    def _speedup_fsdp_shard(self, decision) -> None:
        if self.model is None:
            raise SpeedupConfigError([
                "fsdp.enabled = true with model_init=...: hf_speedup shards the model it is given when the Trainer "
                "is built; fix: pass model=... (hyperparameter search with model_init is not supported with FSDP)"
            ])
        units = shard_model(self.model, ShardSpec.from_settings(decision.settings), device_type=self.args.device.type)
        logger.info("hf_speedup fsdp: sharded %d units: %s", len(units), ", ".join(units))
        # autocast only: no .to(), no DDP, and no accelerate compile (its compile_regions copies the module,
        # which an FSDP2 module refuses; hf_speedup's regional compile feature compiles the blocks instead)
        dynamo = getattr(self.accelerator.state, "dynamo_plugin", None)
        backend = getattr(dynamo, "backend", None)
        if backend is not None and str(getattr(backend, "value", backend)).upper() != "NO":
            from accelerate.utils import DynamoBackend

            logger.warning("hf_speedup fsdp: accelerate's dynamo_config (%s) is not applied to a model hf_speedup "
                           "sharded itself; use the compile feature (speedup compile.enabled) instead", backend)
            dynamo.backend = DynamoBackend.NO
            try:
                self.accelerator.prepare_model(self.model, device_placement=False, evaluation_mode=True)
            finally:
                dynamo.backend = backend
        else:
            self.accelerator.prepare_model(self.model, device_placement=False, evaluation_mode=True)
        compat.mark_prepared_for_accelerate(self.model)

    def create_optimizer(self, *args, **kwargs):
        backend, _ = self._speedup_fsdp()
        if backend == "hf_speedup":  # as the Trainer does before its own FSDP2 optimizer (transformers >= 5.24):
            FSDPModule = compat.fsdp_module_cls()  # a forward before train() (evaluate, a probe) leaves the units
            for module in self.model.modules():  # kept unsharded after forward (head, root) holding plain tensors
                if isinstance(module, FSDPModule):
                    module.reshard()
        optimizer = super().create_optimizer(*args, **kwargs)
        if backend == "hf_speedup":
            DTensor = compat.dtensor_cls()
            ids = {id(p) for p in self.model.parameters()}
            stale = [p for g in compat.unwrap_optimizer(optimizer).param_groups for p in g["params"]
                     if id(p) not in ids or not isinstance(p, DTensor)]
            if stale:
                    raise SpeedupConfigError([
                    f"optimizers = ({type(compat.unwrap_optimizer(optimizer)).__name__}, ...) holds {len(stale)} "
                    "parameter(s) of the unsharded model: FSDP replaces every parameter by a sharded DTensor, so "
                    "that optimizer would update nothing; fix: pass optimizer_cls_and_kwargs=(cls, kwargs) (or "
                    "TrainingArguments.optim) instead of a built optimizer"
                ])
        return optimizer

    # -- saving ----------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        backend, decision = self._speedup_fsdp()
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if backend == "hf_speedup":
            sharded = decision.settings.state_dict_type == "sharded"
            if _internal_call and sharded:
                save_sharded_model(self.model, output_dir)
                self._speedup_save_extras(output_dir)
            else:
                state_dict = full_model_state_dict(self.model)
                if _internal_call and self.args.should_save:  # before _save: save_pretrained may edit the dict
                    os.makedirs(output_dir, exist_ok=True)
                    torch.save(state_dict, os.path.join(output_dir, FULL_MODEL_FILE))
                self._save(output_dir, state_dict=state_dict)
            if self.args.push_to_hub and not _internal_call:
                self.push_to_hub(commit_message="Model save", revision=getattr(self.args, "hub_revision", None))
            return
        if (backend in ("accelerate", LAUNCH_CONFIG) and not _internal_call and getattr(self, "is_fsdp_enabled", False)
                and "FULL_STATE_DICT" not in str(self.accelerator.state.fsdp_plugin.state_dict_type)):
            # The stock Trainer writes no weights here under SHARDED_STATE_DICT; gather them instead.
            self._save(output_dir, state_dict=self.accelerator.get_state_dict(self.model))
            if self.args.push_to_hub:
                self.push_to_hub(commit_message="Model save", revision=getattr(self.args, "hub_revision", None))
            return
        super().save_model(output_dir, _internal_call=_internal_call)

    def _speedup_save_extras(self, output_dir: str) -> None:
        """Rank 0: the config, tokenizer and TrainingArguments next to the sharded weights."""
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        model = self.accelerator.unwrap_model(self.model)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(output_dir)
        if self.processing_class is not None and hasattr(self.processing_class, "save_pretrained"):
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        backend, decision = self._speedup_fsdp()
        if backend != "hf_speedup":
            return super()._save_optimizer_and_scheduler(output_dir)
        if decision.settings.state_dict_type == "sharded":
            save_sharded_optimizer(self.model, self.optimizer, output_dir)
        else:
            osd = full_optimizer_state_dict(self.model, self.optimizer)
            if self.args.should_save:
                torch.save(osd, os.path.join(output_dir, FULL_OPTIMIZER_FILE))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    # -- loading ----------------------------------------------------------------------------------------
    def _speedup_unsharded_fsdp_checkpoint(self, checkpoint: str | None) -> bool:
        """An FSDP checkpoint resumed by a run that does not shard (one process: FSDP is off at world size 1;
        DDP): the stock Trainer refuses it ("... is only supported when using PyTorch FSDP") and would skip its
        optimizer; hf_speedup reads it whole instead (DCP reassembles the shards)."""
        backend, _ = self._speedup_fsdp()
        return (checkpoint is not None and backend != "hf_speedup" and not getattr(self, "is_fsdp_enabled", False)
                and holds_fsdp_state(checkpoint))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        backend, _ = self._speedup_fsdp()
        model = model if model is not None else self.model
        if backend == "hf_speedup":
            loaded = load_model_checkpoint(model, resume_from_checkpoint)
            logger.info("hf_speedup fsdp: model state loaded from %s", loaded)
            return
        if not self._speedup_unsharded_fsdp_checkpoint(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        loaded = load_model_checkpoint(model, resume_from_checkpoint, sharded=False)
        shards = shard_count(resume_from_checkpoint)
        note = (f"resumed from an FSDP checkpoint ({f'{shards} shards' if shards else 'full state dict'}) in a run "
                f"that does not shard: {os.path.basename(loaded)} read whole, optimizer state likewise")
        self._speedup_fsdp_note(note, logging.WARNING)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        backend, _ = self._speedup_fsdp()
        sharded = backend == "hf_speedup"
        if checkpoint is None or not (sharded or self._speedup_unsharded_fsdp_checkpoint(checkpoint)):
            return super()._load_optimizer_and_scheduler(checkpoint)
        loaded = load_optimizer_checkpoint(self.model, self.optimizer, checkpoint, sharded=sharded)
        scheduler = os.path.join(checkpoint, SCHEDULER_FILE)
        if loaded and os.path.isfile(scheduler) and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
        logger.info("hf_speedup fsdp: optimizer state %s", f"loaded from {loaded}" if loaded else "not in checkpoint")

    def _load_best_model(self) -> None:
        backend, _ = self._speedup_fsdp()
        if backend != "hf_speedup":
            return super()._load_best_model()
        load_model_checkpoint(self.model, self.state.best_model_checkpoint)
