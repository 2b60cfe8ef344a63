"""compile.when = pays_back: the first steps run eager and are timed; the blocks compile only when the rest of the
run earns a cold compile back. Checked on the live regions (calls through the compiled callable, dynamo graphs)."""

import logging

import pytest

from conftest import CPU_NO_BF16, CUDA_H100, fake_caps
from hf_speedup import SpeedupConfigError, SpeedupTrainer, get_preset
from hf_speedup import plan_for as build
from hf_speedup.features import compile as rc
from hf_speedup.features.compile import payback as compile_payback
from hf_speedup.features.compile.payback import DECLINED

# dynamic: one graph for every padded length, so any recompile below would be the accounting's, not the shapes'
PAYS_BACK = {"compile": {"enabled": True, "backend": "eager", "mode": None, "dynamic": True, "when": "pays_back"}}


def _config():
    return get_preset("baseline").replace(**PAYS_BACK)


def _train(tiny_model, make_args, dataset, collator, monkeypatch, cost, steps):
    """A run whose payback constants make the verdict certain: (gain 10%, ``cost`` seconds of cold compile)."""
    monkeypatch.setitem(compile_payback.PAYBACK, "cpu", (0.10, cost, cost))
    trainer = SpeedupTrainer(model=tiny_model, args=make_args(max_steps=steps), train_dataset=dataset,
                             data_collator=collator, speedup=_config())
    assert compile_payback.MEASURED_STEPS == 2  # the step counts below: 1 warm-up step + 2 timed, then the verdict
    trainer.train()
    blocks = [r for r in rc.guarded_regions(trainer.model) if r.kind not in rc.HEAD_REGIONS]
    assert len(blocks) == tiny_model.config.num_hidden_layers
    return trainer, blocks


def test_a_run_that_cannot_earn_the_compile_back_stays_eager(tiny_model, make_args, dataset, collator, monkeypatch,
                                                            caplog):
    with caplog.at_level(logging.WARNING, logger="hf_speedup"):
        trainer, blocks = _train(tiny_model, make_args, dataset, collator, monkeypatch, cost=1e9, steps=6)
    assert [(r.calls, r.compiles) for r in blocks] == [(0, 0)] * len(blocks)  # no block forward went compiled
    status = trainer.speedup_status["compile"]
    assert status.engaged is False
    assert "not compiled for this run, it would not pay back: 3 step(s) left" in status.engaged_reason
    assert "fix: compile.when: always" in status.engaged_reason
    assert any("would not pay back" in note for note in status.outcome.notes)
    assert status.reason.count("would not pay back") == 1  # the verdict verify repeats is said once
    assert any("would not pay back" in r.getMessage() for r in caplog.records)  # logged, not silent
    assert trainer.speedup_report.to_dict()["metrics"]["compiled_regions"] == 0
    # never reads as applied: the report's applied says the blocks ran eager
    assert status.applied == DECLINED and trainer.speedup_report.to_dict()["plan"]["compile"]["applied"] == DECLINED


def test_a_run_that_earns_it_back_compiles_after_the_timed_steps(tiny_model, make_args, dataset, collator,
                                                                 monkeypatch):
    trainer, blocks = _train(tiny_model, make_args, dataset, collator, monkeypatch, cost=0.0, steps=6)
    assert [r.calls for r in blocks] == [3] * len(blocks)  # steps 4-6 only: 1 warm-up + 2 timed steps ran eager
    assert sum(r.compiles for r in blocks) == 1  # one graph for every block (shared forward)
    status = trainer.speedup_status["compile"]
    assert status.engaged, status.engaged_reason
    assert "compiling from the next step: 3 step(s) left" in status.reason
    metrics = trainer.speedup_report.to_dict()["metrics"]
    assert metrics["compiled_regions"] == len(blocks)
    # the cold compile came at step 4: it is the cold compile, not recompiling
    assert metrics["compile_seconds"] > 0 and metrics["recompile_seconds"] == 0 and metrics["recompiles"] == 0


def test_a_run_too_short_to_time_is_declined_before_its_first_step(tiny_model, make_args, dataset, collator,
                                                                   monkeypatch):
    trainer, blocks = _train(tiny_model, make_args, dataset, collator, monkeypatch, cost=0.0, steps=3)
    assert [r.calls for r in blocks] == [0] * len(blocks)
    assert "the run has 3 step(s) left, too few" in trainer.speedup_status["compile"].engaged_reason


def test_verdict_arithmetic():
    gate = compile_payback.CompileGate(open_=False)
    gate.decide(step_seconds=0.5, remaining=1000, gain=0.10, cost_seconds=20.0, cost_text="~20 s")  # saves ~50 s > 20 s
    assert gate.open and not gate.declined
    gate = compile_payback.CompileGate(open_=False)
    gate.decide(step_seconds=0.15, remaining=200, gain=0.10, cost_seconds=20.0, cost_text="~20 s")  # saves ~3 s < 20 s
    assert gate.declined and not gate.open and "~3 s" in gate.verdict


def test_fast_defers_on_cpu_and_compiles_from_the_start_where_payback_is_unmeasured_or_ranks_could_disagree(tiny_model):
    def plan_for(config, caps):
        return build(config, caps=caps, model=tiny_model)

    cpu = plan_for("fast", caps=fake_caps(**CPU_NO_BF16))["compile"]
    assert cpu.settings.when == "pays_back"
    assert "the first steps run eager and are timed" in cpu.reason and "~20 s" in cpu.reason
    cuda = plan_for("fast", caps=fake_caps(**CUDA_H100))["compile"]
    assert cuda.settings.when == "always" and "not measured on cuda yet" in cuda.reason
    two = plan_for("fast", caps=fake_caps(**CPU_NO_BF16, world_size=2))["compile"]
    assert two.settings.when == "always" and "on all 2 processes" in two.reason
    explicit = plan_for(get_preset("fast").replace(compile={"when": "always"}), caps=fake_caps(**CPU_NO_BF16))
    assert explicit["compile"].settings.when == "always" and "pays_back" not in explicit["compile"].reason


def test_always_compiles_from_the_first_step(tiny_model, make_args, dataset, collator):
    cfg = get_preset("baseline").replace(compile={"enabled": True, "backend": "eager", "mode": None})
    assert cfg.compile.when == "always"  # the default: an explicit compile is not second-guessed
    trainer = SpeedupTrainer(model=tiny_model, args=make_args(max_steps=3), train_dataset=dataset,
                             data_collator=collator, speedup=cfg)
    trainer.train()
    assert [r.calls for r in rc.guarded_regions(trainer.model)] == [3] * tiny_model.config.num_hidden_layers


def test_bad_when_is_named_with_the_allowed_values():
    with pytest.raises(SpeedupConfigError, match=r"compile\.when = 'later' is not allowed; allowed: 'always', "
                                                 r"'pays_back'"):
        get_preset("fast").replace(compile={"when": "later"})


def test_a_model_reused_by_another_trainer_follows_that_trainers_gate(tiny_model, make_args, dataset, collator,
                                                                      monkeypatch):
    first, _ = _train(tiny_model, make_args, dataset, collator, monkeypatch, cost=0.0, steps=3)  # declined: too short
    always = get_preset("baseline").replace(compile={**PAYS_BACK["compile"], "when": "always"})
    second = SpeedupTrainer(model=first.model, args=make_args(max_steps=3), train_dataset=dataset,
                            data_collator=collator, speedup=always)
    second.train()
    assert [r.calls for r in rc.guarded_regions(second.model)] == [3] * tiny_model.config.num_hidden_layers
    status = second.speedup_status["compile"]
    assert status.engaged and "pays_back" not in status.engaged_reason, status.engaged_reason


def test_a_declined_verdict_is_taken_again_by_the_next_train(tiny_model, make_args, dataset, collator, monkeypatch):
    trainer, blocks = _train(tiny_model, make_args, dataset, collator, monkeypatch, cost=0.0, steps=3)
    assert [r.calls for r in blocks] == [0] * len(blocks)
    trainer.args.max_steps = 10
    trainer.train()
    assert [r.calls for r in blocks] == [7] * len(blocks)  # 10 steps: 3 eager (1 warm-up + 2 timed), then compiled
    notes = [n for n in trainer.speedup_status["compile"].outcome.notes if "pays_back" in n]
    assert len(notes) == 1 and "compiling from the next step: 7 step(s) left" in notes[0]
    assert trainer.speedup_status["compile"].applied == trainer.speedup_plan["compile"].applied  # compiled after all


def test_the_profile_window_opens_after_the_timed_steps_and_the_compile(tiny_model):
    on = {"profile": {"enabled": True}}
    deferred = build(get_preset("fast").replace(**on), caps=fake_caps(**CPU_NO_BF16), model=tiny_model)["profile"]
    assert deferred.settings.window == (6, 7) and "profile.wait 1 -> 4" in deferred.reason
    always = build(get_preset("fast").replace(compile={"when": "always"}, **on), caps=fake_caps(**CPU_NO_BF16),
                   model=tiny_model)["profile"]
    assert always.settings.window == (3, 4)


def test_a_recompile_in_a_process_whose_graphs_are_warm_still_counts_as_recompiling(make_args, dataset, tokenizer):
    """Steps 1-2 reuse the graph an earlier trainer compiled (nothing compiles); step 3's new length recompiles."""
    import torch

    from hf_speedup.tiny import tiny_llama

    class Lengths:
        def __init__(self, switch):
            self.calls, self.switch = 0, switch

        def __call__(self, rows):
            self.calls += 1
            ids = torch.randint(1, 40, (len(rows), 32 if self.calls <= self.switch else 48))
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    static = get_preset("baseline").replace(compile={**PAYS_BACK["compile"], "dynamic": False, "when": "always"})
    torch._dynamo.reset()
    metrics = []
    for switch, steps in ((100, 2), (2, 4)):
        trainer = SpeedupTrainer(model=tiny_llama(seed=0, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                  num_attention_heads=2, num_key_value_heads=2),
                                 args=make_args(max_steps=steps, remove_unused_columns=False), train_dataset=dataset,
                                 data_collator=Lengths(switch), speedup=static)
        trainer.train()
        metrics.append(trainer.speedup_report.to_dict()["metrics"])
    assert metrics[1]["recompiles"] == 1 and metrics[1]["recompile_seconds"] > 0, metrics[1]
    assert metrics[1]["recompile_seconds"] == pytest.approx(metrics[1]["compile_seconds"])  # no cold compile here


# ------------------------------------------------------------------------------------------ this machine's own figures
def _measured_payback(gain, compile_s):
    from hf_speedup.measured import Measurement

    return {compile_payback.KEY: Measurement({"gain": gain, "compile_s": compile_s}, "measured on this machine",
                                             "AMD EPYC, 2 threads", cached=True)}


def test_the_plan_names_where_the_payback_figures_came_from(tiny_model):
    constants = build("fast", caps=fake_caps(**CPU_NO_BF16), model=tiny_model)["compile"]
    assert "constants measured on a 2-core Intel Xeon (AVX-512) and a 2-core AMD EPYC (AVX2), " \
           "benchmarks/RESULTS.md" in constants.reason and "x 10%" in constants.reason
    own = build("fast", caps=fake_caps(**CPU_NO_BF16, measured=_measured_payback(0.13, 17.0)), model=tiny_model)
    reason = own["compile"].reason
    assert "x 13%" in reason and "a cold compile (~17 s)" in reason
    assert "gain 13% and compile 17 s measured on this machine on AMD EPYC, 2 threads (cached)" in reason


@pytest.mark.parametrize("gain, compiled", [(0.0, False), (0.5, True)])
def test_the_gate_decides_by_this_machines_recorded_figures(gain, compiled, tiny_model, make_args, dataset, collator,
                                                            monkeypatch):
    from hf_speedup.hardware import probe

    monkeypatch.setitem(compile_payback.PAYBACK, "cpu", (0.5, 0.0, 0.0))  # the constants alone would compile
    import dataclasses

    monkeypatch.setattr("hf_speedup.trainer.probe", lambda args=None: dataclasses.replace(
        probe(args), measured=_measured_payback(gain, 0.0 if compiled else 1e9)))
    trainer = SpeedupTrainer(model=tiny_model, args=make_args(max_steps=6), train_dataset=dataset,
                             data_collator=collator, speedup=_config())
    trainer.train()
    blocks = [r for r in rc.guarded_regions(trainer.model) if r.kind not in rc.HEAD_REGIONS]
    assert [r.calls for r in blocks] == [3 if compiled else 0] * len(blocks)
    verdict = next(n for n in trainer.speedup_status["compile"].outcome.notes if "pays_back" in n)
    assert f"({gain:.0%} of a step)" in verdict and "measured on this machine" in verdict and "(cached)" in verdict


def test_a_compiled_run_records_its_gain_and_compile_for_later_plans(tiny_model, make_args, dataset, collator,
                                                                     monkeypatch, tmp_path):
    from hf_speedup import measured

    monkeypatch.setenv(measured.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(measured.MEASURE_ENV, "1")
    # 8 steps: 1 warm-up + 2 timed eager, the gate opens, step 4 compiles (cold), steps 5-6 compiled are timed
    trainer, blocks = _train(tiny_model, make_args, dataset, collator, monkeypatch, cost=0.0, steps=8)
    assert [r.calls for r in blocks] == [5] * len(blocks)
    status = trainer.speedup_status["compile"]
    facts = status.outcome.facts["payback_measured"]
    assert facts["compile_s"] >= 0 and facts["compiled_step_s"] > 0 and facts["eager_step_s"] > 0
    assert facts["gain"] == pytest.approx(1 - facts["compiled_step_s"] / facts["eager_step_s"], abs=1e-4)
    assert any("recorded for later plans" in n for n in status.outcome.notes)
    import dataclasses

    again = build(_config(), caps=dataclasses.replace(trainer.speedup_plan.caps, measured={}), model=tiny_model)
    found = again.caps.measured[compile_payback.KEY]
    assert found.cached and found.value == {"gain": facts["gain"], "compile_s": facts["compile_s"]}
    assert f"gain {facts['gain']:.0%} and compile {facts['compile_s']:.0f} s measured on this machine" in \
        again["compile"].reason
