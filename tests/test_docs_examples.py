"""Every ```python block of README.md and docs/*.md runs as written.

The blocks of one page run in order in one namespace (a page is one story: a later block uses
the plan an earlier one built), each page in a fresh Python process with JAX on the CPU, as a
reader pasting them into an interpreter would. Blocks that are not meant to run (fragments,
shell sessions, printed output) use another fence language (```text, ```console, ```bash).
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# An opening fence of exactly "```python" at the start of a line, up to the closing fence.
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)

_RUNNER = """
import sys
scope = {"__name__": "__main__"}
for i in range(1, len(sys.argv), 2):
    exec(compile(sys.argv[i + 1], sys.argv[i], "exec"), scope)
"""


def python_blocks(text):
    """Returns `(first line number, source)` of every ```python block of a Markdown text."""
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in _BLOCK.finditer(text)]


def test_block_extraction_finds_only_python_fences():
    text = "a\n```python\nx = 1\n```\n```text\nnot run\n```\n\n```python\ny = x + 1\n```\n"
    assert python_blocks(text) == [(3, "x = 1\n"), (10, "y = x + 1\n")]


PAGES_WITH_CODE = [p for p in PAGES if python_blocks(p.read_text())]


def test_the_pages_with_examples_are_found():
    names = {p.name for p in PAGES_WITH_CODE}
    # The pages whose examples users copy first; losing one means the fence changed.
    assert {"README.md", "plan.md", "coordinator.md", "serving.md"} <= names, names


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda p: p.name)
def test_page_examples_run(page):
    rel = page.relative_to(ROOT)
    args = []
    for line, source in python_blocks(page.read_text()):
        args += [f"{rel}:{line}", source]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {
        "JAX_PLATFORMS": "cpu",
        "MPLBACKEND": "Agg",
    }
    r = subprocess.run(
        [sys.executable, "-c", _RUNNER, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=900,
        check=False,
    )
    assert r.returncode == 0, f"an example of {rel} failed:\n{r.stderr[-4000:]}"
