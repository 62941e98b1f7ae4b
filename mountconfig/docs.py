"""Render docs/config.md from the schema, so the reference always matches the code."""
from __future__ import annotations

import json

from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from .schema import MountConfig

_HEADER = """# Mount config reference

One TOML file configures a mount. Every key is optional except where a feature needs it;
unknown keys are errors. This page is generated from the schema (`hintfs config-doc`), and a
test checks that it is current.

The smallest useful config:

```toml
[store]
uri = "file:///srv/data"
```

"""


def _default(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            return "(table)"
    else:
        value = field.default
    if value is None:
        return "unset"
    return f"`{json.dumps(to_jsonable_python(value))}`"


def _section(name: str, model: type[BaseModel], out: list[str]) -> None:
    out.append(f"## `[{name}]`\n")
    if model.__doc__ and not model.__doc__.startswith("Usage docs"):
        out.append(model.__doc__.strip() + "\n")
    out.append("| key | type | default | meaning |")
    out.append("|---|---|---|---|")
    nested = []
    for key, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            nested.append((f"{name}.{key}", ann))
            continue
        tname = ann.__name__ if isinstance(ann, type) else str(ann).replace("typing.", "")
        tname = tname.replace("|", "or")
        desc = (field.description or "").replace("|", "\\|").replace("\n", " ")
        out.append(f"| `{key}` | {tname} | {_default(field)} | {desc} |")
    out.append("")
    for sub_name, sub in nested:
        _section(sub_name, sub, out)


def render_config_doc() -> str:
    out = [_HEADER]
    for key, field in MountConfig.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            _section(key, ann, out)
    return "\n".join(out).rstrip() + "\n"
