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
