"""The `# --` comments in values.yaml (helm-docs style) are the one description of each value: this writes
them into the chart README's values table and into values.schema.json's `description`s. And the sidecar's METRICS
(files/sidecar.py) are the one list of its metrics: this writes docs/observability.md's table from it; and the
run-state protocol's CAUSES (train/podstate.py) docs/failures.md's table of why an attempt ends.

    python scripts/values_table.py           # rewrite both
    python scripts/values_table.py --check   # exit 1 if either is stale
"""

import argparse
import json
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "deepspeed-training"
BEGIN, END = "<!-- values-table:begin -->", "<!-- values-table:end -->"
METRICS_DOC = ROOT / "docs" / "observability.md"
METRICS_BEGIN, METRICS_END = "<!-- metrics-table:begin -->", "<!-- metrics-table:end -->"
CAUSES_DOC = ROOT / "docs" / "failures.md"
CAUSES_BEGIN, CAUSES_END = "<!-- causes-table:begin -->", "<!-- causes-table:end -->"
KEY = re.compile(r"^(\s*)([A-Za-z0-9_]+):")


def documented_keys(values_yaml: str) -> dict[str, str]:
    """{'worker.replicas': 'Number of worker pods ...'} for every key preceded by a `# -- ` comment."""
    docs, stack, pending = {}, [], None
    for line in values_yaml.splitlines():
        stripped = line.strip()
        if stripped.startswith("# -- "):  # helm-docs' marker has a space: `# --output_dir` is prose
            pending = [stripped[5:].strip()]
        elif stripped.startswith("#") and pending is not None:
            pending.append(stripped[1:].strip())
        elif match := KEY.match(line):
            indent = len(match.group(1))
            stack = [(i, k) for i, k in stack if i < indent] + [(indent, match.group(2))]
            if pending is not None:
                docs[".".join(k for _, k in stack)] = " ".join(pending)
            pending = None
        elif stripped:
            pending = None
    return docs


def lookup(values: dict, path: str):
    node = values
    for key in path.split("."):
        node = node[key]
    return node


def table(values_yaml: str) -> str:
    values = yaml.safe_load(values_yaml)
    rows = ["| Key | Type | Default | Description |", "| --- | --- | --- | --- |"]
    for path, text in documented_keys(values_yaml).items():
        default = lookup(values, path)
        kind = {dict: "object", list: "list", bool: "bool", int: "int", float: "float", str: "string"}.get(
            type(default), "null")
        shown = json.dumps(default, separators=(", ", ": "))
        description = text.replace("|", "\\|")
        rows.append(f"| `{path}` | {kind} | `{shown}` | {description} |")
    return "\n".join(rows)


def metrics_table() -> str:
    """The sidecar's metrics (podruntime/sidecar.py METRICS): name, label, which pod serves it, what it is."""
    from podruntime import sidecar  # noqa: PLC0415

    rows = ["| metric | label | served by | what |", "| --- | --- | --- | --- |"]
    for name, label, doc, where, _ in sidecar.METRICS:
        rows.append(f"| `{sidecar.METRIC}_{name}` | {f'`{label}`' if label else ''} | {where} | {doc} |")
    return "\n".join(rows)


def causes_table() -> str:
    """Why an attempt ends (podruntime/causes.py CAUSES): the cause, who decides it and from what, the budget."""
    from podruntime import causes  # noqa: PLC0415

    rows = ["| cause | decided by | from | spends the failure budget |", "| --- | --- | --- | --- |"]
    for cause, (who, evidence, budget) in causes.CAUSES.items():
        rows.append(f"| `{cause}` | {who} | {evidence} | {budget} |")
    return "\n".join(rows)


def rules_table() -> str:
    """The pods' policy (podruntime/causes.py ATTEMPT_RULES), in its order."""
    from podruntime import causes  # noqa: PLC0415

    rows = ["| order | cause | when |", "| --- | --- | --- |"]
    for i, rule in enumerate(causes.ATTEMPT_RULES, 1):
        cause = "the rank's own (its end record's)" if rule.cause not in causes.CAUSES else f"`{rule.cause}`"
        rows.append(f"| {i} | {cause} | {rule.evidence} |")
    return "\n".join(rows)


def cluster_rules_table() -> str:
    """make why's refinement (podruntime/causes.py CLUSTER_RULES), strongest first."""
    from podruntime import causes  # noqa: PLC0415

    rows = ["| strength | cause | what the API server shows |", "| --- | --- | --- |"]
    for i, rule in enumerate(causes.CLUSTER_RULES, 1):
        rows.append(f"| {i} | `{rule.cause}` | {rule.evidence} |")
    return "\n".join(rows)


def between(text: str, begin: str, end: str, body: str) -> str:
    start, stop = text.index(begin) + len(begin), text.index(end)
    return text[:start] + "\n" + body + "\n" + text[stop:]


def schema_with_descriptions(schema: dict, docs: dict[str, str]) -> dict:
    """`schema` with each documented key's description set from its `# --` comment."""
    schema = json.loads(json.dumps(schema))
    for path, text in docs.items():
        node = schema
        for key in path.split("."):
            node = node["properties"][key]
        node["description"] = text
    return schema


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    readme = CHART / "README.md"
    text = readme.read_text()
    values_yaml = (CHART / "values.yaml").read_text()
    fresh = between(text, BEGIN, END, table(values_yaml))
    schema_path = CHART / "values.schema.json"
    schema_text = schema_path.read_text()
    fresh_schema = json.dumps(schema_with_descriptions(json.loads(schema_text), documented_keys(values_yaml)),
                              indent=2, ensure_ascii=False) + "\n"
    metrics_text = METRICS_DOC.read_text()
    fresh_metrics = between(metrics_text, METRICS_BEGIN, METRICS_END, metrics_table())
    causes_text = CAUSES_DOC.read_text()
    fresh_causes = between(causes_text, CAUSES_BEGIN, CAUSES_END, causes_table())
    fresh_causes = between(fresh_causes, "<!-- rules-table:begin -->", "<!-- rules-table:end -->", rules_table())
    fresh_causes = between(fresh_causes, "<!-- cluster-rules-table:begin -->", "<!-- cluster-rules-table:end -->",
                           cluster_rules_table())
    files = ((readme, text, fresh), (schema_path, schema_text, fresh_schema),
             (METRICS_DOC, metrics_text, fresh_metrics), (CAUSES_DOC, causes_text, fresh_causes))
    if args.check:
        stale = [str(p) for p, old, new in files if old != new]
        if stale:
            print(f"{', '.join(stale)}: stale; run `python scripts/values_table.py`", file=sys.stderr)
            return 1
        return 0
    for path, old, new in files:
        if old != new:
            path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
