"""Render docs/config.md from the schema, so the reference always matches the code.

Every key of every table is rendered: the tables (`[store]`, ...), the arrays of tables
(`[[routes]]`, `[[transforms]]`, `[[governor.gpus]]`) and the per-kind `params` of a transform
rule. tests/unit/test_config_doc_keys.py walks the models independently and checks that each key
appears in its section.
"""
from __future__ import annotations

import json
import types
import typing
from collections.abc import Iterator

from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from hintfs.transforms.params import PARAMS_BY_KIND

from .schema import MountConfig

_HEADER = """# Mount config reference

One TOML file configures a mount. Every key is optional except where a feature needs it (a key
marked *required* must be given in each entry of its array of tables); unknown keys are errors.
This page is generated from the schema (`hintfs config-doc`), and a test checks that it is
current.

The smallest useful config:

```toml
[store]
uri = "file:///srv/data"
```

Arrays of tables (`[[routes]]`, `[[transforms]]`, `[[governor.gpus]]`) take one entry per
`[[...]]` block, in order:

```toml
[[transforms]]
glob = "videos/*.mp4"
kind = "video"
params = { frames = 8, size = 224, crop = [224, 224], normalize = true }

[[routes]]
prefix = "ckpt"
local_agent = "grpc://tier-agent:8815"

[[governor.gpus]]
index = 0
total_bytes = 150_000_000_000
```

"""

# Fields whose schema (outside mountconfig) carries no description of its own.
_MEANING = {
    ("TransformRule", "kind"): "`image` (JPEG/PNG/WebP) or `video`; selects the `params` table below.",
    ("TransformRule", "params"): "The transform's parameters (an inline table), per `kind`: see the "
                                 "two `params` sections below; every key has a default.",
    ("ImageParams", "mean"): "Per-channel mean (RGB) subtracted when `normalize` is true (ImageNet's).",
    ("ImageParams", "std"): "Per-channel standard deviation (RGB, > 0) divided by when `normalize` is "
                            "true (ImageNet's).",
}
_MEANING.update({("VideoParams", k): v for (m, k), v in _MEANING.items() if m == "ImageParams"})


def _default(field) -> str:
    if field.is_required():
        return "*required*"
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            return "(table)"
    else:
        value = field.default
    if value is None:
        return "unset"
    return f"`{json.dumps(to_jsonable_python(value))}`"


def list_item_model(ann) -> type[BaseModel] | None:
    """The model of an array of tables (`list[Model]`), else None."""
    if typing.get_origin(ann) is list:
        (item,) = typing.get_args(ann) or (None,)
        if isinstance(item, type) and issubclass(item, BaseModel):
            return item
    return None


def union_models(ann) -> list[type[BaseModel]]:
    """The models of a union of tables (a transform rule's `params`), else []."""
    if typing.get_origin(ann) is typing.Union:
        members = [a for a in typing.get_args(ann) if a is not type(None)]
        if members and all(isinstance(a, type) and issubclass(a, BaseModel) for a in members):
            return members
    return []


def _type_name(ann) -> str:
    if list_item_model(ann) is not None:
        return "array of tables"
    if union_models(ann):
        return "table"
    return _format_type(ann)


def _format_type(ann) -> str:
    """A readable type: constraints (Annotated) dropped, Optional spelled out."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Annotated:
        return _format_type(args[0])
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        inner = " or ".join(_format_type(a) for a in rest)
        return f"Optional[{inner}]" if len(rest) < len(args) else inner
    if origin is typing.Literal:
        return f"Literal[{', '.join(repr(a) for a in args)}]"
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_format_type(a) for a in args)}]"
    return ann.__name__ if isinstance(ann, type) else str(ann).replace("typing.", "")


def sections() -> Iterator[tuple[str, type[BaseModel], str]]:
    """(heading, model, intro) of every table of the config, in the order of the page."""
    def walk(name: str, model: type[BaseModel], array: bool) -> Iterator[tuple[str, type[BaseModel], str]]:
        doc = model.__doc__ or ""
        intro = "" if doc.startswith("Usage docs") else doc.strip()
        yield (f"`[[{name}]]`" if array else f"`[{name}]`"), model, intro
        for key, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                yield from walk(f"{name}.{key}", ann, False)
            elif (item := list_item_model(ann)) is not None:
                yield from walk(f"{name}.{key}", item, True)
            for member in union_models(ann):
                kind = next(k for k, m in PARAMS_BY_KIND.items() if m is member)
                head = f"`[[{name}]]` `{key}` for `kind = \"{kind}\"`"
                yield head, member, (member.__doc__ or "").strip()

    for key, field in MountConfig.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from walk(key, ann, False)
        elif (item := list_item_model(ann)) is not None:
            yield from walk(key, item, True)


def _section(heading: str, model: type[BaseModel], intro: str, out: list[str]) -> None:
    out.append(f"## {heading}\n")
    if intro:
        out.append(" ".join(intro.split()) + "\n")
    out.append("| key | type | default | meaning |")
    out.append("|---|---|---|---|")
    for key, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            continue   # a table of its own below
        meaning = field.description or _MEANING.get((model.__name__, key), "")
        desc = meaning.replace("|", "\\|").replace("\n", " ")
        out.append(f"| `{key}` | {_type_name(ann)} | {_default(field)} | {desc} |")
    out.append("")


def render_config_doc() -> str:
    out = [_HEADER]
    for heading, model, intro in sections():
        _section(heading, model, intro, out)
    return "\n".join(out).rstrip() + "\n"
