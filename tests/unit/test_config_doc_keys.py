"""docs/config.md documents every key of the config: this walks the pydantic models of
mountconfig/ (tables, arrays of tables, the per-kind params of a transform rule) on its own,
not through the generator, and finds each key in the section of its table."""
from __future__ import annotations

import re
import typing
from pathlib import Path

from pydantic import BaseModel

from mountconfig import MountConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def _models_in(ann) -> list[type[BaseModel]]:
    """The models a field's annotation holds: a table, an array of tables, a union of tables."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [ann]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(ann):
        found.extend(_models_in(arg))
    return found


def walk(model: type[BaseModel], path: str):
    """(dotted path of the table, its model) for every table reachable from `model`."""
    for key, field in model.model_fields.items():
        for sub in _models_in(field.annotation):
            yield f"{path}.{key}".lstrip("."), sub
            yield from walk(sub, f"{path}.{key}")


def doc_sections() -> dict[str, set[str]]:
    """Heading -> the keys its table lists."""
    sections: dict[str, set[str]] = {}
    heading = None
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            heading = line[3:]
            sections[heading] = set()
        elif heading is not None and (m := re.match(r"\| `([A-Za-z0-9_]+)` \|", line)):
            sections[heading].add(m.group(1))
    return sections


TABLES = list(walk(MountConfig, ""))


def test_the_walk_reaches_the_arrays_of_tables():
    paths = {p for p, _ in TABLES}
    assert {"store", "governor", "governor.gpus", "routes", "transforms", "transforms.params"} <= paths
    assert {m.__name__ for p, m in TABLES if p == "transforms.params"} == {"ImageParams", "VideoParams"}


def test_every_key_is_documented_in_its_section():
    sections = doc_sections()
    missing = []
    for path, model in TABLES:
        table = path.split(".")[-1]
        keys = set(model.model_fields)
        # the section of this table: its heading names it, and it lists the most of its keys
        candidates = [(len(keys & listed), h) for h, listed in sections.items()
                      if f"[{path}]" in h or f"[[{path}]]" in h or f"`{table}`" in h]
        assert candidates, f"no section for [{path}] ({model.__name__}) in docs/config.md"
        _, heading = max(candidates)
        absent = keys - sections[heading]
        missing += [f"{path}.{k} ({model.__name__})" for k in sorted(absent)]
    assert not missing, "keys not in docs/config.md (run `hintfs config-doc > docs/config.md`): " + ", ".join(missing)


def test_every_top_level_key_has_a_section():
    headings = " ".join(doc_sections())
    for key in MountConfig.model_fields:
        assert f"[{key}]" in headings, key
