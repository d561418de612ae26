"""docs/config.md, generated: every section and field of the config with its default and description,
and each task's options. Regenerate with `python -m leangrpo.commands.configdoc > docs/config.md`; the
table of TRL's GRPOConfig fields in docs/trl.md with `python -m leangrpo.commands.configdoc --trl-table`
(tests check that both are current)."""

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
        "(`python -m leangrpo.commands.configdoc > docs/config.md`).",
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


def trl_table() -> str:
    """docs/trl.md's table: every TRL 1.16 GRPOConfig field, how leangrpo handles it, and where it goes
    or why (from `config.trl.field_table`, the lists the translation itself uses)."""
    from leangrpo.config.trl import field_table

    lines = ["| TRL field | leangrpo | field, or why |", "|---|---|---|"]
    lines += [f"| `{name}` | {how} | {why} |" for name, how, why in field_table()]
    return "\n".join(lines) + "\n"


def _default(field: Any) -> str:
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return ""
    return f"`{yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}`"


if __name__ == "__main__":
    import sys

    print(trl_table() if sys.argv[1:] == ["--trl-table"] else reference(), end="")
