"""The API reference builds from the docstrings (pdoc, offline) and covers the public surface.

The README's "Development" section gives the build command; this test runs the same build into
a temporary folder, so an import error, a broken docstring or a package left out of the
command fails here rather than on a reader's machine.
"""

import pathlib
import pkgutil
import re
import warnings

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


def test_readme_command_names_only_public_packages():
    assert set(readme_command_modules()) <= set(public_packages())


def test_api_reference_builds_and_documents_the_public_names(tmp_path):
    # pdoc warns (and goes on) when it cannot resolve an annotation or is given one module
    # twice: the reference would show a raw string or the command a redundant name.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.pdoc(*readme_command_modules(), output_directory=tmp_path)
    assert not [str(w.message) for w in caught], [str(w.message) for w in caught]
    pages = {p.relative_to(tmp_path).as_posix(): p for p in tmp_path.rglob("*.html")}
    # Every public package has its page: pdoc follows a package's __all__, which lists names,
    # not subpackages (a name that is also a subpackage, as kernels_pallas.write_rows, is
    # followed), so a package the command neither names nor reaches would be missing.
    missing = [p for p in public_packages() if p.replace(".", "/") + ".html" not in pages]
    assert not missing, f"no API page for {missing}: add them to the README's pdoc command"

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
