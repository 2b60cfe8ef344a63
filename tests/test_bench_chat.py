"""``hf-speedup bench`` on real-length chat data: the ``docs-chat`` rows (built offline from the standard library's
documentation) and the padding-free peers (``stock-flat``: the stock Trainer with transformers'
``DataCollatorWithFlattening``; ``trl-sft``: TRL's ``padding_free=True``), checked on the batches they receive.

No timing is asserted; the real model (SmolLM2) runs in ``benchmarks/`` only.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from hf_speedup.bench import BenchOptions
from hf_speedup.bench.chat_data import (PLAIN_TEMPLATE, TOKEN_RANGE, build_rows, distribution, fingerprint, render,
                                        rows_for_run)
from hf_speedup.bench.data import make_rows
from hf_speedup.config import SpeedupConfigError


@pytest.fixture(scope="module")
def rows(tokenizer_module):
    return build_rows(tokenizer_module, seq_len=512, seed=0)


@pytest.fixture(scope="module")
def tokenizer_module():
    from hf_speedup.tiny import char_tokenizer

    return char_tokenizer()


def test_docs_chat_rows_are_deterministic_and_within_bounds(rows, tokenizer_module):
    lengths = [len(r["input_ids"]) for r in rows]
    assert len(rows) > 50  # at one token a character (the tiny tokenizer) most conversations exceed 512
    assert min(lengths) >= TOKEN_RANGE[0] and max(lengths) <= 512  # 40..min(1024, seq_len); longer ones dropped
    assert all(r["attention_mask"] == [1] * len(r["input_ids"]) for r in rows)
    assert build_rows(tokenizer_module, seq_len=512, seed=0) == rows  # same Python, same rows, same order
    other = build_rows(tokenizer_module, seq_len=512, seed=1)
    assert fingerprint(other) != fingerprint(rows)  # the seed draws other answer lengths and another order
    d = distribution(lengths)
    assert d["min"] <= d["median"] <= d["p90"] <= d["max"] and d["rows"] == len(rows)
    assert len({r["question"] for r in rows}) > 0.9 * len(rows)  # questions about different objects and topics


def test_docs_chat_uses_the_chat_template_or_plain_user_assistant_lines(tokenizer_module):
    from hf_speedup.tiny import chat_tokenizer

    chat = chat_tokenizer()  # its template: "u:<question>|a:<answer>|"
    assert chat.decode(render(chat, "what is 1+1?", "2")).replace(" ", "") == "u:whatis1+1?|a:2|"  # char by char
    plain = render(tokenizer_module, "what is 1+1?", "2")
    assert plain == tokenizer_module(PLAIN_TEMPLATE.format(question="what is 1+1?", answer="2"))["input_ids"]


def test_a_run_gets_exactly_the_rows_it_asks_for_the_same_in_every_worker(tokenizer_module, rows):
    few = rows_for_run(tokenizer_module, 12, 512, seed=0)
    assert [r["input_ids"] for r in few] == [r["input_ids"] for r in rows[:12]]  # the first of the seeded order
    many = make_rows(tokenizer_module, "docs-chat", len(rows) + 5, 512, seed=0)
    assert len(many) == len(rows) + 5 and many[len(rows)]["input_ids"] == rows[0]["input_ids"]  # then from the start
    with pytest.raises(ValueError, match=r"--data docs-chat: no conversation fits 40\.\.39 tokens; fix: raise --seq-len"):
        rows_for_run(tokenizer_module, 4, 39)


def test_docs_chat_needs_rows_of_40_tokens(tmp_path):
    BenchOptions(variants=["stock-flat"], data="docs-chat", seq_len=1024, output=str(tmp_path / "o")).validate()
    with pytest.raises(SpeedupConfigError, match=r"--seq-len = 30 is too short for --data docs-chat .*allowed: >= 40; "
                                                 r"fix: --seq-len 1024"):
        BenchOptions(variants=["stock"], data="docs-chat", seq_len=30, output=str(tmp_path / "o")).validate()


# ------------------------------------------------------------------------------------------ padding-free peers
class Batches:
    """A TokenMeter that also keeps every batch the trainer's ``training_step`` received."""

    def __init__(self):
        from hf_speedup.bench.meters import TokenMeter

        self.meter = TokenMeter()
        self.seen: list[dict] = []

    def add(self, inputs):
        self.seen.append({k: v.clone() for k, v in inputs.items() if hasattr(v, "clone")})
        self.meter.add(inputs)

    def close_step(self):
        self.meter.close_step()


def test_the_stock_bf16_peer_trains_the_stock_trainer_under_bf16_autocast(tmp_path, tokenizer_module):
    """``stock-bf16``: the stock Trainer with ``bf16=True`` (what a user tries first), whatever the bench's own
    precision for the peers: its accelerator runs the step under bf16 autocast, the weights stay fp32."""
    import torch
    from transformers import Trainer

    from hf_speedup.bench.variants import build_trainer

    data = make_rows(tokenizer_module, "ragged", 8, 64, seed=0)
    opts = BenchOptions(variants=["stock-bf16"], batch_size=4, steps=2, seq_len=64).to_dict()
    spec = {"variant": "stock-bf16", "kind": "peer", "options": opts, "device": "cpu", "bf16": False,
            "output": str(tmp_path), "slug": "stock-bf16", "total_steps": 2}
    trainer = build_trainer(spec, Batches(), tokenizer_module, data)
    assert isinstance(trainer, Trainer) and trainer.args.bf16 is True
    assert trainer.accelerator.mixed_precision == "bf16"
    trainer.train()
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}


@pytest.mark.parametrize("peer", ["stock-flat", "trl-sft"])
def test_padding_free_peers_train_on_flat_rows_without_padding(tmp_path, tokenizer_module, peer):
    """Each batch the trainer steps on is one row holding the batch's sequences back to back: no pad token, no
    attention mask, position_ids restarting at 0 at every sequence, labels never crossing a boundary."""
    import torch

    from hf_speedup.bench.data import as_dataset
    from hf_speedup.bench.variants import build_trainer

    if peer == "trl-sft" and importlib.util.find_spec("trl") is None:
        pytest.skip("trl is not installed")
    tok = tokenizer_module
    data = make_rows(tok, "ragged", 12, 96, seed=0)
    opts = BenchOptions(variants=[peer], batch_size=4, steps=3, seq_len=96).to_dict()
    spec = {"variant": peer, "kind": "peer", "options": opts, "device": "cpu", "bf16": False, "output": str(tmp_path),
            "slug": peer, "total_steps": 3}
    batches = Batches()
    trainer = build_trainer(spec, batches, tok, as_dataset(data) if peer == "trl-sft" else data)
    trainer.train()
    assert len(batches.seen) == 3
    lengths = sorted(len(r["input_ids"]) for r in data)
    seen_lengths = []
    for batch in batches.seen:
        ids, pos, labels = batch["input_ids"], batch["position_ids"], batch["labels"]
        assert ids.shape[0] == 1 and pos.shape == ids.shape == labels.shape  # one flat row
        assert "attention_mask" not in batch or bool(batch["attention_mask"].all())
        assert not bool((ids == tok.pad_token_id).any())  # nothing padded
        starts = (pos[0] == 0).nonzero().flatten().tolist()
        assert len(starts) == 4 and starts[0] == 0  # position_ids restart at every one of the 4 sequences
        bounds = starts[1:] + [ids.shape[1]]
        seen_lengths += [b - a for a, b in zip(starts, bounds)]
        for a, b in zip(starts, bounds):
            assert torch.equal(pos[0, a:b], torch.arange(b - a))
        # the first token of each sequence is never a target (no prediction across a boundary)
        assert bool((labels[0, starts] == -100).all())
    assert sorted(seen_lengths) == lengths  # every row trained on once, whole
    batches.close_step()  # (the bench's callback closes each step; here the three in one)
    assert batches.meter.per_step() == [sum(lengths)]  # counted as the report counts: every real token


@pytest.mark.slow
def test_bench_on_docs_chat_with_the_padding_free_peers(tmp_path):
    """``hf-speedup bench --data docs-chat``: the rows are made once (written under the output), described in the
    notes, and every peer counts the same tokens on them."""
    from hf_speedup.cli import main as cli_main

    out = tmp_path / "bench"
    peers = "stock-flat,trl-sft" if importlib.util.find_spec("trl") else "stock-flat"
    rc = cli_main(["bench", "--tiny", "--data", "docs-chat", "--seq-len", "256", "--steps", "2", "--batch-size", "2",
                   "--peers", peers, "--presets", "auto", "--output", str(out)])
    assert rc == 0
    report = json.loads((out / "bench.json").read_text())
    rows = {v["name"]: v for v in report["variants"]}
    assert all(v["status"] == "ok" for v in rows.values()), {n: v.get("reason") for n, v in rows.items()}
    note = next(n for n in report["notes"] if n.startswith("data: docs-chat"))
    assert "tokens per row min" in note and "median" in note and "p90" in note and "fingerprint" in note
    written = [json.loads(line)["input_ids"] for line in (out / "data" / "docs-chat.jsonl").read_text().splitlines()]
    assert len(written) == 2 * 3 and all(TOKEN_RANGE[0] <= len(r) <= 256 for r in written)  # steps + tracked step
    counted = {n: v["metrics"]["tokens_counted"] for n, v in rows.items()}
    assert len(set(counted.values())) == 1, counted  # same rows, same order, no padding counted


# ------------------------------------------------------------------------------- benchmarks/payback_check.py
def test_payback_check_derives_cost_saving_and_payback_from_timelines():
    """Synthetic timelines with a known answer: eager 2 s a step after a 10 s start; compiled 1.5 s a step after a
    10 s start plus a 40 s compile in step 1: saving 0.5 s a step, cost 40 s, pays back after 80 steps."""
    import importlib.util
    from pathlib import Path

    from hf_speedup.bench.options import preset_config
    from hf_speedup.features.compile.payback import PAYBACK

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "payback_check.py"
    spec = importlib.util.spec_from_file_location("payback_check", path)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    eager = [10 + 2 * i for i in range(1, 41)]
    compiled = [10 + 40 + 1.5 * i for i in range(1, 41)]
    compiled[20] += 9  # one slow step (a recompile, the machine's noise) shifts the median by nothing
    compiled[21:] = [t + 9 for t in compiled[21:]]
    results = {"eager": {"ends": eager}, "compiled": {"ends": compiled}}
    out = check.analyse(results, [10, 30, 40], 40)
    assert out["whole_run_s"]["eager"] == {10: 30, 30: 70, 40: 90}
    assert out["steady_step_s"] == {"eager": 2, "compiled": 1.5}
    m = out["measured"]
    assert m["saving_per_step_s"] == pytest.approx(0.5) and m["gain"] == pytest.approx(0.25)
    assert m["compile_cost_s"] == pytest.approx(40 + 9)  # the slow step is part of what compiling cost
    assert m["payback_step"] == pytest.approx(98)
    gain, cold, _ = PAYBACK["cpu"]
    assert out["predicted"]["payback_step"] == pytest.approx(cold / (gain * 2))
    # each run is the preset with one edit (and the precision edit when asked), all valid configs
    for run in check.RUNS:
        config = preset_config(check.spec_of(run, "fast", "bf16", []))
        assert config.precision.dtype == "bf16"
    assert preset_config(check.spec_of("eager", "fast", None, [])).compile.enabled is False
    assert preset_config(check.spec_of("compiled", "fast", None, [])).compile.when == "always"
    assert preset_config(check.spec_of("pays_back", "fast", None, [])).compile.when == "pays_back"
