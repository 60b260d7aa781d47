"""The README and docs/ say what the code does: links land, names exist, the module map is the tree.

The generated tables (settings, exit codes) are checked in tests/test_settings.py, the faults count in
tests/test_faults_inventory.py, the deploy and scaling guides in tests/test_cloud_specs.py and
tests/test_k8s_scale.py; these checks cover what no single test owns.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from conftest import ROOT
from trainer.core import settings

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _prose(page: Path) -> str:
    """The page without its fenced code blocks (a shell line's brackets are no link)."""
    return FENCE.sub("", page.read_text())


def _anchors(page: Path) -> set[str]:
    """GitHub's heading ids (lower case, punctuation dropped but - and _, spaces to hyphens), and `<a id="...">` anchors."""
    prose = _prose(page)
    headings = re.findall(r"^#{1,6} (.+)$", prose, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings} | set(re.findall(r'<a id="([^"]+)"></a>', prose))


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(_prose(page)):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:: not ours to check offline
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no file {linked.relative_to(ROOT) if linked.is_relative_to(ROOT) else linked}")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.name}")
    return broken


def test_every_link_in_the_readme_and_docs_lands_on_a_file_and_heading(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [gone](missing.md) [moved](#no-such-heading)\n```\n[not a link](x)\n```\n")
    assert broken_links(page) == [f"missing.md: no file {tmp_path / 'missing.md'}", "#no-such-heading: no heading #no-such-heading in page.md"]
    assert {page.name: broken for page in PAGES if (broken := broken_links(page))} == {}


DOC_REFERENCE = re.compile(r"(?<![\w/.-])((?:docs/)?[a-z][a-z0-9-]*\.md|README\.md)(?:#([A-Za-z0-9_-]+))?")


def code_references() -> list[tuple[str, str, str]]:
    """(file, page, anchor) for every docs page a message, a help text or a docstring in trainer/ or entrypoint.py names,
    and a comment in bench/, k8s/, deploy/, the Dockerfile or the requirements."""
    found = []
    beside = [*(ROOT / "bench").rglob("*.py"), *(ROOT / "bench").glob("*.sh"), *(ROOT / "k8s").rglob("*.yaml"), *(ROOT / "deploy").rglob("*"),
              ROOT / "Dockerfile", *ROOT.glob("requirements*.txt")]
    for path in [ROOT / "entrypoint.py", *sorted((ROOT / "trainer").rglob("*.py")), *sorted(p for p in beside if p.is_file())]:
        for page, anchor in DOC_REFERENCE.findall(path.read_text(errors="replace")):
            found.append((str(path.relative_to(ROOT)), page, anchor))
    return found


def test_every_docs_page_and_heading_the_code_names_exists():
    """An error message or a help text that sends a user to a page or a section must find it (two once named README
    sections that had moved)."""
    references = code_references()
    assert len(references) > 20  # the pattern finds them: settings' help texts alone name a dozen
    broken = []
    for module, page, anchor in references:
        target = ROOT / page if page.startswith(("docs/", "README")) else ROOT / "docs" / page
        if not target.exists():
            broken.append(f"{module}: {page} does not exist")
        elif anchor and not anchor.endswith("-") and anchor not in _anchors(target):  # `#exit-{code}`: a template
            broken.append(f"{module}: {page} has no heading #{anchor}")
    assert broken == []


def test_no_message_sends_a_user_to_a_readme_section_by_name():
    """The README is a first screen; its sections move (the table of variables went to docs/settings.md).  Messages name a
    docs page and heading instead, which the test above checks."""
    said = [(path.name, line.strip()) for path in sorted((ROOT / "trainer").rglob("*.py"))
            for line in path.read_text().splitlines() if re.search(r"README's [^)\"]*?section|README's table of variables", line)]
    assert said == []


def test_the_readmes_page_list_and_the_architectures_name_every_docs_page_once():
    """One home per topic: a page added, folded into another or renamed shows in the README's list of pages and in
    docs/architecture.md's account of why each page is its own."""
    pages = sorted(page.name for page in (ROOT / "docs").glob("*.md"))
    readme = README.read_text().split("## Documentation\n", 1)[1].split("\n## ", 1)[0]
    assert sorted(re.findall(r"^\| \[docs/([\w-]+\.md)\]", readme, re.M)) == pages
    why = (ROOT / "docs" / "architecture.md").read_text().split("## The docs' pages\n", 1)[1].split("\n## ", 1)[0]
    assert sorted(re.findall(r"^- \*\*\[([\w-]+\.md)\]", why, re.M)) == pages


def test_every_ft_name_in_the_readme_and_docs_is_a_setting():
    """A setting renamed or removed leaves no page telling users to set it."""
    unknown = {page.name: sorted(set(re.findall(r"\bFT_[A-Z0-9_]*[A-Z0-9]\b", page.read_text())) - set(settings.BY_ENV_NAME)) for page in PAGES}
    assert {name: names for name, names in unknown.items() if names} == {}


def test_the_readme_fits_a_first_screen_and_shows_your_own_model_and_data():
    text = README.read_text()
    assert len(text.encode()) <= 15 * 1024, "the README is the first screen: move detail to docs/"
    blocks = "\n".join(re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M))
    assert re.search(r"^FT_MODEL=\S+ FT_DATASET=\S+ .*python entrypoint\.py$", blocks, re.M), "the host command for your own model and data"
    assert re.search(r"-e FT_MODEL=\S+ -e FT_DATASET=\S+", blocks), "the docker form of it"
    assert blocks.index("pip install -r requirements-dev.txt") < blocks.index('python -m pytest -q -m "not slow"'), "pytest comes from requirements-dev.txt"


def test_the_volume_table_names_every_path_the_job_writes_at_the_top_of_the_volume():
    from trainer.core.volume import Volume

    text = README.read_text()
    table = text.split("## What lands on the volume\n", 1)[1].split("\n## ", 1)[0]
    volume = Volume("/v")
    paths = {getattr(volume, name) for name, value in vars(Volume).items() if isinstance(value, property)}
    top = {os.path.basename(p) for p in paths if isinstance(p, str) and os.path.dirname(p) == "/v"}
    assert len(top) >= 10
    assert sorted(name for name in top if f"`{name}" not in table) == [], "add a row for each to the README's volume table"


def test_the_module_map_lists_every_module_and_only_modules_that_exist():
    page = ROOT / "docs" / "architecture.md"
    text = page.read_text()
    table = text[text.index("<!-- modules:start -->") : text.index("<!-- modules:end -->")]
    listed = re.findall(r"^\| `([\w/.]+\.py)` \|", table, re.M)
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "trainer").rglob("*.py") if p.name != "__init__.py"} | {"entrypoint.py"}
    assert len(listed) == len(set(listed)), "each module is listed once"
    assert sorted(set(listed) - modules) == [], f"rows for modules that are gone: update {page.name}"
    assert sorted(modules - set(listed)) == [], f"modules missing from {page.name}'s map"


def test_help_strings_say_what_a_setting_does_in_a_sentence_or_two():
    """The why and the measurements live in docs/ (linked from the help); a help string that grows past this
    is doing a page's job."""
    for s in settings.TABLE:
        sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z`(])", re.sub(r"\(\[[^\]]*\]\([^)]*\)\)", "", s.help).strip())
        assert len(s.help) <= 400 and len(sentences) <= 2, (s.env_name, len(s.help), sentences)


def test_the_readme_serves_the_demo_from_the_store_it_wrote_and_says_how_to_get_torch_for_cpu():
    text = README.read_text()
    blocks = "\n".join(re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M))
    assert "FT_PRESET=demo FT_OUTPUT_DIR=./out python entrypoint.py" in blocks
    serve = [line for line in blocks.splitlines() if "trainer.serving.openai_server" in line]
    # the demo's embedded store is FT_OUTPUT_DIR/mlflow/mlflow.db; without MLFLOW_TRACKING_URI MLflow makes an empty one here
    assert serve and all(line.startswith("MLFLOW_TRACKING_URI=sqlite:///$PWD/out/mlflow/mlflow.db python -m") for line in serve), serve
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in text, "the CPU build, not CUDA's GBs"
    assert ".venv-deploy/bin/pip install -r deploy/requirements-validators.txt" in text, "the validators' own venv is named"
