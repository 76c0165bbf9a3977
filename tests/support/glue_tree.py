"""A copy of values/ and templates/ for tests to break, and helpers to edit it and run deployctl in-process."""

import shutil

import pytest
import yaml

from scripts import deployctl
from scripts.deployctl import common
from tests.support.chart import ROOT


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A copy of values/ and templates/ to break; build/ goes to tmp as well."""
    shutil.copytree(ROOT / "values", tmp_path / "values")
    shutil.copytree(ROOT / "templates", tmp_path / "templates")
    monkeypatch.setattr(common, "VALUES", tmp_path / "values")
    monkeypatch.setattr(common, "TEMPLATES", tmp_path / "templates")
    monkeypatch.setattr(common, "BUILD", tmp_path / "build")
    monkeypatch.setattr(common, "ROOT", tmp_path)
    return tmp_path


def edit(path, change):
    data = yaml.safe_load(path.read_text()) or {}
    change(data)
    path.write_text(yaml.safe_dump(data))


def run(*args, capsys):
    code = deployctl.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def set_key(rel, *path_value):
    *path, value = path_value

    def change(data):
        node = data
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return lambda tree: edit(tree / "values" / rel, change)


def write(rel, text):
    return lambda tree: (tree / rel).write_text(text)


