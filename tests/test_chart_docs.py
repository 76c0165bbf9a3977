"""values.yaml documents every key, and the chart README's table is generated from it."""

import subprocess
import sys

import yaml

from scripts.values_table import documented_keys
from tests.support.chart import CHART, ROOT


def key_paths(node, prefix=""):
    for key, value in node.items():
        path = f"{prefix}{key}"
        yield path, value
        if isinstance(value, dict):
            yield from key_paths(value, path + ".")


def test_every_value_has_a_doc_comment():
    text = (CHART / "values.yaml").read_text()
    docs = documented_keys(text)
    missing = []
    for path, value in key_paths(yaml.safe_load(text)):
        ancestors = [".".join(path.split(".")[:i]) for i in range(1, path.count(".") + 1)]
        if path in docs or any(a in docs for a in ancestors) or (isinstance(value, dict) and value):
            continue  # documented, inside a documented value, or a section whose keys are documented
        missing.append(path)
    assert missing == [], f"values.yaml keys without a `# --` comment: {missing}"
    assert text.startswith("# yaml-language-server: $schema=values.schema.json")


def test_every_value_is_typed_in_the_schema():
    import json
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    for path, _ in key_paths(yaml.safe_load((CHART / "values.yaml").read_text())):
        node = schema
        for key in path.split("."):
            if "properties" not in node:
                break  # an open object (pass-through pod settings, ds_config)
            assert key in node["properties"], f"{path} is not in values.schema.json"
            node = node["properties"][key]
            node = schema["definitions"][node["$ref"].split("/")[-1]] if "$ref" in node else node


def test_readme_values_table_is_generated_from_values_yaml():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "values_table.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_only_the_helm_docs_marker_starts_a_description():
    docs = documented_keys("a:\n  # -- Flags: `--x` or\n  # --output_dir <dir>, in prose.\n  b: 1\n")
    assert docs == {"a.b": "Flags: `--x` or --output_dir <dir>, in prose."}


def test_every_image_tag_and_chart_version_is_the_projects_version():
    """pyproject.toml holds the version (scripts/pins.py reads it for the Makefile, the image and cluster scripts,
    and Chart.yaml through scripts/chart_data.py --check); the tags the values files, the chart's CI values and the
    docs spell out must follow it."""
    import re

    from scripts.pins import pins

    version = pins()["version"]
    spelled = re.compile(r"\b(\d+\.\d+\.\d+)-(?:cpu|cuda|rocm)\b|deepspeed-sidecar:(\d+\.\d+\.\d+)")
    files = [*ROOT.glob("values/**/*.yaml"), *(CHART / "ci").glob("*.yaml"), *ROOT.glob("docs/*.md"),
             ROOT / "README.md", CHART / "README.md", CHART / "values.yaml"]
    stale = [f"{path.relative_to(ROOT)}: {match.group(0)}" for path in files
             for match in spelled.finditer(path.read_text()) if version not in match.groups()]
    assert stale == [], f"tags that do not name the project's version {version}: {stale}"
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (chart["version"], chart["appVersion"]) == (version, version)


def test_every_test_a_comment_or_doc_names_exists():
    """A comment or doc that says which test holds a check names a test file (and function, or module) that
    exists."""
    import re

    tests = {path.relative_to(ROOT).as_posix(): path.read_text() for path in ROOT.glob("tests/**/*.py")}
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    reference = re.compile(r"\btests/[\w/]+\.py(?:::(\w+))?|\b(test_\w{6,})\b(?![.*/])")
    missing = []
    for name in tracked:
        if name.startswith("tests/") or not name.endswith((".py", ".md", ".sh", ".tpl", ".yaml", ".j2", "Makefile")):
            continue
        for match in reference.finditer((ROOT / name).read_text(errors="replace")):
            path = match.group(0).split("::")[0]
            function = match.group(1) or match.group(2)
            if path.startswith("tests/") and path not in tests:
                missing.append(f"{name}: {match.group(0)}")
            elif function and not any(f"def {function}(" in text for text in tests.values()) and \
                    not any(path.endswith(f"/{function}.py") for path in tests):  # a test module, imported
                missing.append(f"{name}: {match.group(0)}")
    assert missing == [], f"named tests that do not exist: {missing}"
