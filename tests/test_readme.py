"""The README's code runs as written.

Every ```python block of README.md is saved as a file and run in a fresh process (cwd
a temporary directory, the osdp this test imported on PYTHONPATH, a free MASTER_PORT,
a private profile cache):

- a block whose first line is ``# torchrun <args> NAME.py`` runs as
  ``python -m torch.distributed.run <args> <the block's file>``;
- a block with a line ``# not run by tests/test_readme.py: <why>`` is skipped (it says
  why in the README; at most one such block);
- a block with a line ``# slow in tests/test_readme.py: <why>`` runs with the ``slow``
  tests (``.ci/run`` runs them when its budget allows);
- any other block runs as ``python <the block's file>``.

Each must exit 0. The README's two one-line commands are checked for what can be
checked here (they are the exact lines, CI runs the second verbatim, the entry point,
the `demo` command and the `test` extra exist).
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import osdp
from runtime.dist_harness import free_port

REPO = Path(osdp.__file__).resolve().parent.parent
README = REPO / "README.md"
SKIP_MARK = "# not run by tests/test_readme.py:"
DEMO_COMMAND = "pip install torch==2.13.0 -e . && osdp demo"
TEST_COMMAND = 'pip install torch==2.13.0 -e ".[test]" && python -m pytest -q'


def python_blocks(text: str) -> list[tuple[str, str]]:
    """(the heading above it, code) for every ```python block, in order."""
    blocks, heading = [], "top"
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#") and not line.startswith("#!"):
            heading = line.lstrip("#").strip()
        if line.strip() == "```python":
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            blocks.append((heading, "\n".join(lines[i + 1 : end]) + "\n"))
            i = end
        i += 1
    return blocks


BLOCKS = python_blocks(README.read_text())


def test_readme_has_the_expected_blocks():
    assert len(BLOCKS) >= 4, [h for h, _ in BLOCKS]
    skipped = [h for h, code in BLOCKS if SKIP_MARK in code]
    assert len(skipped) <= 1, f"too many README blocks are not run: {skipped}"
    for _, code in BLOCKS:
        for line in code.splitlines():
            if line.startswith(SKIP_MARK):
                assert line[len(SKIP_MARK):].strip(), "a skipped block must say why"


def _env(tmp_path: Path) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OSDP_CACHE_DIR=str(tmp_path / "cache"),
                OMP_NUM_THREADS="1")


SLOW_MARK = "# slow in tests/test_readme.py:"  # such a block runs with the `slow` tests


@pytest.mark.parametrize("index", [pytest.param(i, marks=pytest.mark.slow) if SLOW_MARK in code else i
                                   for i, (_, code) in enumerate(BLOCKS)],
                         ids=[f"{i}-{h}" for i, (h, _) in enumerate(BLOCKS)])
def test_readme_python_block_runs(index, tmp_path):
    heading, code = BLOCKS[index]
    if SKIP_MARK in code:
        pytest.skip(code.split(SKIP_MARK, 1)[1].splitlines()[0].strip())
    first = code.splitlines()[0]
    if first.startswith("# torchrun "):
        args = shlex.split(first[2:])[1:]
        script = tmp_path / args[-1]
        cmd = [sys.executable, "-m", "torch.distributed.run", *args[:-1], str(script)]
    else:
        script = tmp_path / f"readme_block_{index}.py"
        cmd = [sys.executable, str(script)]
    script.write_text(code)
    done = subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (
        f"README block {index} ({heading!r}) exited {done.returncode}\n--- code\n{code}\n--- stdout\n"
        f"{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-5000:]}"
    )


def test_readme_one_line_commands_are_true():
    text = README.read_text()
    bash = re.findall(r"```bash\n(.*?)```", text, re.S)
    lines = [line.strip() for block in bash for line in block.splitlines()]
    assert DEMO_COMMAND in lines and TEST_COMMAND in lines
    assert TEST_COMMAND in (REPO / ".ci" / "run").read_text(), "CI must run the README's test command verbatim"
    setup = (REPO / "setup.py").read_text()
    assert '"osdp=osdp.cli:main"' in setup
    test_extra = re.search(r'"test":\s*\[(.*?)\]', setup).group(1)
    assert "pytest" in test_extra and "transformers" in test_extra
    from osdp.cli import build_parser

    assert build_parser().parse_args(["demo"]).command == "demo"
    for line in lines:  # the torchrun commands name files that exist
        for word in line.split():
            if word.endswith(".py"):
                assert (REPO / word).is_file(), f"README names {word}, which does not exist"
