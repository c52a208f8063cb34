"""The README's promises that can be checked without a fresh machine."""

import re

from .conftest import ROOT


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    test_cmd = next(b for b in blocks if "pytest" in b)
    assert test_cmd in (ROOT / ".ci" / "run").read_text()


def test_committed_notebooks_have_no_outputs():
    import json

    for nb in (ROOT / "notebooks").glob("*.ipynb"):
        cells = json.loads(nb.read_text())["cells"]
        assert not any(c.get("outputs") or c.get("execution_count") for c in cells if c["cell_type"] == "code"), nb


def test_readme_images_exist():
    readme = (ROOT / "README.md").read_text()
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", readme)
    assert images, "the README shows the report"
    for path in images:
        assert (ROOT / path).is_file(), path
