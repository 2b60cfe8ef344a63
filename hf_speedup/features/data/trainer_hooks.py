"""The data feature's part in the trainer: the Trainer's loaders (the training one may drop its last partial batch;
evaluation and prediction batch as the user's setup would, seeing every row), and the training set checked
against the plan before any work."""

from __future__ import annotations

from .collators import evaluation_collator, evaluation_loader
from .inputs import dataset_problems
from .loaders import training_loader


class DataTrainerHooks:
    """The Trainer's three loaders, built inside the data feature's contexts; pass-throughs when it changes nothing."""

    def get_eval_dataloader(self, eval_dataset=None):
        """Stock evaluation loader, batched by the user's collator (see ``collators.evaluation_collator``)."""
        with evaluation_loader(self):
            return super().get_eval_dataloader(eval_dataset)

    def get_test_dataloader(self, test_dataset):
        """Stock prediction loader, batched by the user's collator (see ``collators.evaluation_collator``)."""
        with evaluation_loader(self):
            return super().get_test_dataloader(test_dataset)

    def get_train_dataloader(self):
        """Stock training loader; where the plan drops the last partial batch (static-shape compile), this loader
        alone does: ``args.dataloader_drop_last`` stays the user's, so evaluation and prediction see every row."""
        with training_loader(self):
            return super().get_train_dataloader()


TRAINER_HOOKS = DataTrainerHooks


def problems(decision, setup) -> list[str]:
    """What the training set cannot do with the trainer's collator (ragged rows are fine where the plan flattens)."""
    settings = decision.settings
    return dataset_problems(setup.train_dataset, setup.args, collator=setup.data_collator,
                            processing_class=setup.processing_class,
                            flattens=bool(settings.padding_free or settings.rows_flattened))


def attach(decision, trainer, outcome, setup) -> None:
    """The collator evaluation and prediction batch with (``trainer.speedup_eval_collator``; None: the training one)."""
    trainer.speedup_eval_collator = evaluation_collator(trainer, setup.users_collator, setup.data_collator, setup.args)


def stock_trainer_warnings(decision, args_cls: str) -> list[str]:
    """What a stock ``TrainingArguments`` cannot carry of the data decision (``training_arguments()`` logs it)."""
    settings, out = decision.settings, []
    if settings.train_drop_last:
        out.append(f"data.drop_last (the last partial training batch) cannot be expressed in {args_cls}, whose "
                   "dataloader_drop_last drops evaluation and prediction rows too: dropped here (it only spares a "
                   "recompile of SpeedupTrainer's regional compile)")
    if settings.padding_free_via == "collator":
        out.append(f"data.padding_free (padding-free rows) replaces the collator and cannot be expressed in {args_cls}: "
                   "the stock Trainer keeps padding; use SpeedupTrainer (or, with TRL, sft_config, which sets "
                   "SFTConfig.padding_free)")
    return out
