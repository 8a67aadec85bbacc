"""Every ```python block of README.md runs as written, each in a fresh
interpreter from an empty directory.

The model ids the snippets load (`mlx_lm.load("mlx-community/...")`)
resolve, offline, to the tiny random-weight model of `tests/serve_model.py`
placed in a private Hugging Face cache under those ids: the snippets run
unchanged, with no download. What a snippet prints is checked where the
README states it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.serve_model import build_model_dir

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SNAPSHOT = "0" * 40


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), re.M | re.S)


def model_ids(blocks: list[str]) -> set[str]:
    return {m for block in blocks for m in re.findall(r'mlx_lm\.load\("([^"]+)"\)', block)}


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    """A Hugging Face cache holding the tiny model under every id the README loads."""
    home = tmp_path_factory.mktemp("hf")
    # heads of 64 dims, as real models have (quantized pages need a group size dividing them)
    tiny = build_model_dir(tmp_path_factory.mktemp("tiny"),
                           shape={"hidden_size": 128, "num_attention_heads": 2,
                                  "num_key_value_heads": 1, "head_dim": 64})
    for repo in model_ids(python_blocks()):
        root = home / "hub" / ("models--" + repo.replace("/", "--"))
        shutil.copytree(tiny, root / "snapshots" / SNAPSHOT)
        (root / "refs").mkdir()
        (root / "refs" / "main").write_text(SNAPSHOT)
    return home


def test_the_readme_has_its_snippets():
    blocks = python_blocks()
    assert len(blocks) >= 8
    assert blocks[0].lstrip().startswith("from blockmgr import BlockManager")
    for block in blocks:  # every name a snippet uses comes from an import in it
        for name in ("Engine", "SamplingParams", "AsyncEngine", "PagedCache", "mx"):
            if re.search(rf"\b{name}\b[.(]", block):
                assert re.search(rf"^(from \S+ )?import .*\b{name}\b", block, re.M), \
                    (name, block[:200])


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_python_block_runs_as_written(index, hf_home, tmp_path):
    block = python_blocks()[index]
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"README python block {index}:\n{block}\n{done.stderr}"
    if index == 0:  # the README says what it prints
        assert done.stdout.strip() == "5"
