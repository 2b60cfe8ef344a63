"""Every code block in the docs runs (README.md, CONTRIBUTING.md, docs/**/*.md); conventions in tests/doc_blocks.py.

One test per page: its python blocks in one namespace, in a fresh process, cwd a temporary folder; blocks marked
``<!-- docs: needs gpu -->`` (multi-node, network) are checked without running; ``hf-speedup`` lines of shell
blocks are parsed by the CLI and run (``--help`` unless ``--tiny``). The tests of the collector itself run it on
small pages written here, so a runner that passes everything fails them.
"""

from __future__ import annotations

import textwrap

import pytest
from doc_blocks import (ROOT, Block, MarkerError, check_static, collect, doc_pages, hf_speedup_commands, page_timeout,
                        run_page, runs_for_real, tiny_runs)


def _params(mode: str):
    out = []
    for page in doc_pages():
        try:
            blocks = collect(page)
        except MarkerError:  # the page's own test fails with the message, the others still run
            blocks = []
        if mode == "tiny" and not tiny_runs(blocks):
            continue
        marks = [pytest.mark.timeout(page_timeout(blocks, mode) + 60)]  # the page's own timeout fires first
        out.append(pytest.param(page, marks=marks, id=page.relative_to(ROOT).as_posix()))
    return out


@pytest.mark.parametrize("page", _params("checks"))
def test_every_code_block_of_the_page_runs(page):
    """Python blocks run (marked ones checked), every hf-speedup line parsed and run with --help."""
    result = run_page(page)
    assert result.returncode == 0, f"{page.relative_to(ROOT)}:\n{result.stdout[-12000:]}\n{result.stderr[-3000:]}"


@pytest.mark.slow  # each real `hf-speedup ... --tiny` run takes minutes
@pytest.mark.parametrize("page", _params("tiny"))
def test_the_tiny_commands_of_the_page_run_for_real(page):
    result = run_page(page, "tiny")
    assert result.returncode == 0, f"{page.relative_to(ROOT)}:\n{result.stdout[-12000:]}\n{result.stderr[-3000:]}"


# ------------------------------------------------------------------------------------------- the collector itself
def _page(tmp_path, text: str, name: str = "page.md"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def test_blocks_of_a_page_share_one_namespace_and_run_in_a_temporary_folder(tmp_path):
    page = _page(tmp_path, """
        # A page

        ```python
        import os
        x = 41
        start = os.getcwd()
        ```

        Some prose.

        ```py
        x += 1
        assert x == 42
        assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["WANDB_MODE"] == "offline"
        open("made_by_the_page.txt", "w").write("in the page's own folder")
        ```
        """)
    result = run_page(page)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 blocks, 0 failed" in result.stdout
    assert not (tmp_path / "made_by_the_page.txt").exists()


def test_indentation_inside_a_block_is_kept_and_a_list_items_indent_removed(tmp_path):
    page = _page(tmp_path, """
        ```python
        total = 0
        for i in range(3):
            if i:
                total += i
        ```

        1. In a list:

           ```python
           def twice(x):
               return 2 * x
           assert twice(total) == 6
           ```
        """)
    blocks = collect(page)
    assert blocks[0].source == "total = 0\nfor i in range(3):\n    if i:\n        total += i\n"
    assert blocks[1].source.splitlines()[1] == "    return 2 * x"
    result = run_page(page)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_failing_python_block_fails_and_names_the_page_and_line(tmp_path):
    page = _page(tmp_path, """
        Intro.

        ```python
        a = 1
        ```

        ```python
        b = a + 1
        raise ValueError(f"broken example {b}")
        ```

        ```python
        never_run = True
        ```
        """)
    result = run_page(page)
    assert result.returncode == 1
    assert "FAILED page.md:7 (python block at line 7)" in result.stdout.replace(str(tmp_path) + "/", "")
    assert "ValueError: broken example 2" in result.stdout
    assert 'page.md", line 9' in result.stdout  # the traceback points into the markdown page
    assert "SKIPPED" in result.stdout and "1 failed" in result.stdout


def test_a_page_that_runs_too_long_fails(tmp_path):
    page = _page(tmp_path, """
        ```python
        import time
        time.sleep(60)
        ```
        """)
    result = run_page(page, timeout=5)
    assert result.returncode != 0 and "timed out after 5 s" in result.stdout


def test_a_marked_block_is_not_run_but_its_imports_and_hf_speedup_names_are_checked(tmp_path):
    good = _page(tmp_path, """
        <!-- docs: needs gpu -->
        ```python
        import torch
        import hf_speedup
        from hf_speedup import SpeedupTrainer, estimate_memory
        from hf_speedup.features import profile
        hf_speedup.enable_expandable_segments()
        torch.cuda.synchronize()
        raise SystemExit("a marked block must not run")
        ```
        """, "good.md")
    result = run_page(good)
    assert result.returncode == 0, result.stdout + result.stderr

    bad = _page(tmp_path, """
        <!-- docs: needs multi-node -->
        ```python
        import hf_speedup
        from hf_speedup import SpeedupTrainer, NoSuchTrainer
        import not_a_module_anywhere
        hf_speedup.no_such_function()
        ```
        """, "bad.md")
    result = run_page(bad)
    assert result.returncode == 1
    for expected in ("hf_speedup has no 'NoSuchTrainer'", "not_a_module_anywhere", "hf_speedup.no_such_function"):
        assert expected in result.stdout, result.stdout


def test_check_static_finds_syntax_errors_and_attribute_chains(tmp_path):
    block = Block(tmp_path / "p.md", 10, "python", "import hf_speedup.features as f\nf.profile.NoSuchCallback\n",
                  "network")
    assert check_static(block) == ["line 12: f.profile.NoSuchCallback: no hf_speedup.features.profile.NoSuchCallback"]
    broken = Block(tmp_path / "p.md", 10, "python", "trainer = Trainer(a=1, ...)\n", "gpu")
    assert check_static(broken) == ["line 11: syntax error: positional argument follows keyword argument"]


def test_an_unknown_marker_is_an_error_not_a_skipped_block(tmp_path):
    page = _page(tmp_path, """
        <!-- docs: needs cuda -->
        ```python
        pass
        ```
        """)
    with pytest.raises(MarkerError, match="unknown marker <!-- docs: needs cuda -->"):
        collect(page)


def test_hf_speedup_lines_are_found_and_only_tiny_ones_run_for_real(tmp_path):
    page = _page(tmp_path, """
        ```bash
        pip install hf_speedup            # not run
        hf-speedup plan --preset fast --tiny | head -5
        $ hf-speedup estimate --model PATH --seq-len 2048 \\
            --memory 24GB   # or --tiny
        ```

        ```console
        $ hf-speedup presets
        auto     what the output looks like
        ```
        """)
    blocks = collect(page)
    assert [b.lang for b in blocks] == ["shell", "shell"]
    commands = [c for b in blocks for c in hf_speedup_commands(b)]
    assert commands == [(3, ["plan", "--preset", "fast", "--tiny"]),
                        (4, ["estimate", "--model", "PATH", "--seq-len", "2048", "--memory", "24GB"]),
                        (9, ["presets"])]
    assert [runs_for_real(argv, blocks[0]) for _, argv in hf_speedup_commands(blocks[0])] == [True, False]
    assert tiny_runs(blocks) == 1 and tiny_runs(blocks[1:]) == 0
    for mode in ("checks", "tiny"):
        result = run_page(page, mode)
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"({mode}): 2 blocks, 0 failed" in result.stdout


def test_an_hf_speedup_line_with_an_unknown_flag_or_command_fails(tmp_path):
    page = _page(tmp_path, """
        ```sh
        hf-speedup estimate --seq-len 512 --no-such-flag 3
        hf-speedup no-such-command
        ```
        """)
    result = run_page(page)
    assert result.returncode == 1
    assert "FAILED page.md:2" in result.stdout.replace(str(tmp_path) + "/", "")
    assert "unrecognized arguments: --no-such-flag 3" in result.stdout
    assert "invalid choice: 'no-such-command'" in result.stdout


def test_a_tiny_line_runs_for_real_in_the_tiny_mode_only(tmp_path):
    page = _page(tmp_path, """
        ```bash
        hf-speedup estimate --tiny --seq-len 64 --memory 1KB    # does not fit: exit status 1
        ```
        """)
    assert run_page(page, "checks").returncode == 0  # parsed, and run with --help
    result = run_page(page, "tiny")
    assert result.returncode == 1
    assert "hf-speedup estimate --tiny --seq-len 64 --memory 1KB: exit status 1" in result.stdout, result.stdout


def test_launch_lines_and_speedup_yaml_blocks_are_checked_without_running(tmp_path):
    """Launcher options by the launcher's own parser, repository paths, examples/finetune.py's arguments and its
    --speedup, and a SpeedupConfig YAML block: each mistake fails, the good lines (placeholders too) pass."""
    page = _page(tmp_path, """
        <!-- docs: needs gpu -->
        ```bash
        accelerate launch --config_file configs/accelerate/fsdp2_full_shard.yaml --machine_rank $NODE_RANK \\
            examples/finetune.py --speedup configs/speedup/fast-fsdp.yaml --model PATH_OR_ID
        torchrun --nproc_per_node 8 --no-such-torchrun-flag examples/finetune.py --speedup lora
        accelerate launch --config_file configs/accelerate/no_such.yaml examples/finetune.py --speedup lora
        torchrun --nproc_per_node 2 examples/finetune.py --speedup lora --no-such-script-flag
        python3 examples/finetune.py --speedup no-such-preset
        accelerate launch --help
        python3 -m pip install -e . && python3 examples/finetune.py --no-such-after-and
        sbatch --nodes 2 examples/slurm/train.sbatch --no-such-sbatch-arg examples/finetune.py
        ```

        ```yaml
        base: fast
        compile:
          mode: warp-speed
        ```

        ```yaml
        compile:
          when: sometimes
        ```

        ```yaml
        steps: 3
        ```
        """)
    result = run_page(page)
    out = result.stdout.replace(str(tmp_path) + "/", "")
    assert result.returncode == 1, out
    assert "page.md:3 " not in out  # the good line, placeholders and all
    assert "torchrun: its parser refuses" in out and "--no-such-torchrun-flag" in out
    assert "configs/accelerate/no_such.yaml: no such file in the repository" in out
    assert "examples/finetune.py: its parser refuses" in out and "--no-such-script-flag" in out
    assert "--speedup no-such-preset: no such preset" in out
    assert "not a SpeedupConfig" in out and "warp-speed" in out
    assert "--no-such-after-and" in out  # the second command of a line
    assert "sbatch's torchrun: its parser refuses" in out and "--no-such-sbatch-arg" in out
    assert "page.md:9 " not in out  # --help passes
    assert "compile.when = 'sometimes' is not allowed" in out  # sections alone are a SpeedupConfig's part
    assert "8 failed" in out  # other YAML only parses
