"""The one Jinja renderer: StrictUndefined, so a missing variable is an error naming the variable and the
template, never an empty string. Helm owns the manifests; Jinja makes only the values file and ds_config."""

import json
from pathlib import Path

import jinja2


class TemplateError(ValueError):
    """A template could not be rendered; names the template, the line and the variable."""


def _environment(root: Path) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(root)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["tojson"] = lambda value: json.dumps(value)
    # JSON is YAML that every reader types alike: Helm (YAML 1.2) reads back what we checked (YAML 1.1).
    # U+0085, U+2028 and U+2029 stay escaped: a YAML reader takes them for line breaks, even inside quotes.
    env.filters["to_json"] = lambda value: (json.dumps(value, indent=2, ensure_ascii=False)
                                            .replace("\u0085", "\\u0085").replace("\u2028", "\\u2028")
                                            .replace("\u2029", "\\u2029"))
    return env


def render(root: Path, template: str, variables: dict) -> str:
    """Renders `root/template` with `variables`."""
    try:
        return _environment(root).get_template(template).render(**variables)
    except jinja2.TemplateNotFound:
        known = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.j2"))
        raise TemplateError(f"{root / template}: no such template; known: {', '.join(known)}") from None
    except jinja2.UndefinedError as err:
        raise TemplateError(f"{root / template}: {err.message}; pass it in the values") from None
    except jinja2.TemplateSyntaxError as err:
        raise TemplateError(f"{err.filename or template}:{err.lineno}: {err.message}") from None
