"""docs/config.md, generated: every section and field of the config with its default and description,
and each task's options. Regenerate with `python -m leangrpo.tools.configdoc > docs/config.md` (a test
checks that the file is current)."""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel

from leangrpo.config.schema import Config, LoraConfig, ModelConfig, Section
from leangrpo.data.tasks import available, task_class


def reference() -> str:
    """The text of docs/config.md."""
    lines = [
        "# Config reference",
        "",
        "Generated from the field descriptions in `src/leangrpo/config/schema.py` "
        "(`python -m leangrpo.tools.configdoc > docs/config.md`).",
        "Set any field on the command line as `section.key=value` (values are YAML).",
    ]

    def rows(model: type[BaseModel], prefix: str) -> list[str]:
        out = []
        for name, field in model.model_fields.items():
            if isinstance(field.annotation, type) and issubclass(field.annotation, Section):
                continue
            default = "required" if field.is_required() else _default(field)
            out.append(f"| `{prefix}{name}` | {default} | {field.description or ''} |")
        return out

    for name, field in Config.model_fields.items():
        section = field.annotation
        if not (isinstance(section, type) and issubclass(section, Section)):
            continue
        lines += [
            "",
            f"## `{name}`: {field.description}",
            "",
            (section.__doc__ or "").strip().replace("\n    ", " "),
        ]
        lines += ["", "| key | default | meaning |", "|---|---|---|", *rows(section, f"{name}.")]
        if section is ModelConfig:
            lines += rows(LoraConfig, "model.lora.")
    lines += ["", "## Top level", "", "| key | default | meaning |", "|---|---|---|", *rows(Config, "")]
    for task in available():
        cls = task_class(task)
        lines += ["", f"## Task `{task}`", "", (cls.__doc__ or "").strip().replace("\n    ", " ")]
        if cls.Options.model_fields:
            lines += ["", "| key | default | meaning |", "|---|---|---|", *rows(cls.Options, "task.")]
    return "\n".join(lines) + "\n"


def _default(field: Any) -> str:
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return ""
    return f"`{yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}`"


if __name__ == "__main__":
    print(reference(), end="")
