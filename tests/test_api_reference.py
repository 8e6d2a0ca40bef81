"""The API reference builds from the docstrings (pdoc, offline) and covers the public surface.

The README's "Development" section gives the build command; this test runs the same build into
a temporary folder, so an import error, a broken docstring or a package left out of the
command fails here rather than on a reader's machine.
"""

import pathlib
import pkgutil
import re

import pdoc

import flatkv_jax
import kernels_pallas

ROOT = pathlib.Path(__file__).parent.parent


def public_packages():
    """Every public package of the two distributions (no leading underscore), sorted."""
    names = {"flatkv_jax", "kernels_pallas"}
    for top in (flatkv_jax, kernels_pallas):
        for info in pkgutil.walk_packages(top.__path__, top.__name__ + "."):
            if info.ispkg and not any(p.startswith("_") for p in info.name.split(".")):
                names.add(info.name)
    return sorted(names)


def readme_command_modules():
    """The module names of the README's `python -m pdoc -o ...` command."""
    m = re.search(r"^python -m pdoc -o \S+ (.+)$", (ROOT / "README.md").read_text(), re.M)
    assert m, "README.md lost its API reference command (python -m pdoc -o <dir> <modules>)"
    return sorted(m.group(1).split())


def test_readme_command_names_every_public_package():
    # pdoc follows each package's __all__, which lists names, not subpackages: a package the
    # command does not name would be missing from the reference.
    assert readme_command_modules() == public_packages()


def test_api_reference_builds_and_documents_the_public_names(tmp_path):
    pdoc.pdoc(*readme_command_modules(), output_directory=tmp_path)
    pages = {p.relative_to(tmp_path).as_posix(): p for p in tmp_path.rglob("*.html")}

    def text(page):
        assert page in pages, f"{page} was not generated; generated: {sorted(pages)}"
        return pages[page].read_text()

    expected = {
        "flatkv_jax.html": ["CachePlan", "ServingLimits", "plan_for_budget", "create_pools"],
        "flatkv_jax/coordinator.html": ["create_state", "admit", "step_metadata", "sleep"],
        "flatkv_jax/serving.html": ["Engine", "EngineOptions"],
        "flatkv_jax/model.html": ["DeepSeekV4", "StepBatch"],
        "flatkv_jax/oracle.html": ["RadixOracle"],
        "kernels_pallas.html": ["write_rows", "zero_pages", "Impl"],
    }
    for page, names in expected.items():
        html = text(page)
        for name in names:
            # pdoc gives every documented name an anchor with its qualified name.
            assert f'id="{name}"' in html, f"{name} is not documented in {page}"
    # Docstrings are rendered, not just names: the plan's opening sentence is on its page.
    assert flatkv_jax.CachePlan.__doc__.split("\n")[0].split()[0] in text("flatkv_jax.html")
