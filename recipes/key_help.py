"""Every key of a chosen option, with its value and what it means: ``python train.py --help
strategy=fsdp2`` lists, after the common keys, each key of that option's schema (a strategy: its
family's dataclass; a group: ``GROUP_SCHEMAS``'s), with its value as the command line composes it
and the first sentence of the field's attribute docstring. Python keeps no attribute docstrings
at run time: they are read from the schema's source with ``ast``, once per class. Torch-free:
the schemas and Hydra's composition only (``--help`` imports no engine)."""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
import sys
from pathlib import Path
from typing import Any

# The group whose options have no schema of their own: an experiment chooses the options of
# other groups, and sets their keys (those are listed).
NO_SCHEMA = ("experiment",)


@functools.cache
def _class_docs(module: str, qualname: str) -> dict[str, str]:
    """The attribute docstrings of class ``qualname`` of ``module``: the string literal right
    after each annotated assignment of its body, by field name ({} where the source is not there:
    a class made at run time)."""
    path = getattr(sys.modules.get(module), "__file__", None)
    if not path or not Path(path).is_file():
        return {}
    node: Any = ast.parse(Path(path).read_text())
    for part in qualname.split("."):
        node = next((n for n in node.body if isinstance(n, ast.ClassDef) and n.name == part), None)
        if node is None:
            return {}
    out = {}
    for stmt, after in zip(node.body, node.body[1:]):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(after, ast.Expr) \
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            out[stmt.target.id] = after.value.value
    return out


def field_doc(cls: type, name: str) -> str:
    """The attribute docstring of field ``name`` of dataclass ``cls``, from the class (of its MRO)
    that declares it; "" when it has none."""
    for klass in cls.__mro__:
        if name in vars(klass).get("__annotations__", {}):
            return _class_docs(klass.__module__, klass.__qualname__).get(name, "")
    return ""


def meaning(doc: str) -> str:
    """A docstring's first sentence on one line: the text up to the first full stop outside
    brackets that ends the sentence (a capital, a bracket or the end follows), without rst's
    double backticks, lower-cased where a plain capitalised word starts it ("Free gathered
    parameters ..." -> "free gathered parameters ..."; not "None: ...", "HSDP: ...", "DeepSpeed")."""
    text = " ".join(doc.replace("``", "").split())
    depth = 0
    for i, c in enumerate(text):
        depth += (c in "([{") - (c in ")]}")
        if c == "." and depth <= 0 and re.match(r"\s+[A-Z0-9(\"'`]|\s*$", text[i + 1:]):
            text = text[:i]
            break
    if re.match(r"[A-Z][a-z]*([-/][a-z]+)* ", text):
        text = text[0].lower() + text[1:]
    return text


def nested(f: dataclasses.Field) -> type | None:
    """The dataclass a field holds (``cluster.sagemaker``: ``SageMakerConfig``), or None."""
    made = f.default_factory
    return made if isinstance(made, type) and dataclasses.is_dataclass(made) else None


def schema_keys(cls: type, prefix: str = "") -> list[tuple[str, str]]:
    """(key, docstring) of every leaf field of ``cls``, nested dataclasses' fields by their
    dotted key (``sagemaker.base_job_name``)."""
    out = []
    for f in dataclasses.fields(cls):
        inner = nested(f)
        out += schema_keys(inner, f"{prefix}{f.name}.") if inner else [(f"{prefix}{f.name}", field_doc(cls, f.name))]
    return out


def shown(value: object) -> str:
    """A value as an override writes it: true, null, [a,b], {k:v}."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(map(shown, value)) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{shown(v)}" for k, v in value.items()) + "}"
    return str(value)


def _select(node: object, key: str) -> object:
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def schema_of(group: str, node: dict) -> type | None:
    """The schema of ``group``'s composed ``node``: a strategy's family, a group's own."""
    from recipes.config import GROUP_SCHEMAS, PathsConfig

    if group == "strategy":
        import strategies

        return strategies.families().get(node.get("family"))
    return GROUP_SCHEMAS.get(group) or {"paths": PathsConfig}.get(group)


def section(group: str, option: str, node: dict, why: str = "") -> list[str]:
    """``group=option``'s keys: a heading, then one line a key, ``key=value`` and its meaning."""
    cls = schema_of(group, node)
    if cls is None:
        return [f"{group}={option}: no keys of its own"]
    family = f"family {node.get('family')}" if group == "strategy" else ""
    notes = "; ".join(n for n in (family, why) if n)
    head = f"{group}={option}" + (f" ({notes})" if notes else "") + ":"
    rows = [(f"{group}.{key}={shown(_select(node, key))}", meaning(doc)) for key, doc in schema_keys(cls)]
    width = min(max(len(k) for k, _ in rows), 44) + 2
    return [head] + [f"  {k:<{max(width, len(k) + 2)}}{what}".rstrip() for k, what in rows]


def _requested(overrides: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """(the overrides to compose with, one value per sweep; the (group, option) pairs the
    command line names). A sweep of a group (``strategy=ddp,fsdp2``) names each of its options."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from recipes.compose import _default_choices

    groups = {*_default_choices(), *NO_SCHEMA}
    keep, named = [], []
    for arg in overrides:
        try:
            parsed = OverridesParser.create().parse_overrides([arg])[0]
            values = [str(v) for v in parsed.sweep_string_iterator()] if parsed.is_sweep_override() else None
        except Exception:  # noqa: BLE001  (malformed: composing it says what is wrong)
            keep.append(arg)
            continue
        key = arg.partition("=")[0].lstrip("+~")
        option = arg.partition("=")[2] if values is None else values[0]
        keep.append(arg if values is None else f"{arg.partition('=')[0]}={option}")
        if key in groups and not arg.startswith("~"):
            named += [(key, v) for v in (values or [option])]
    return keep, named


def option_keys(argv: list[str] | tuple[str, ...], script: str = "train.py") -> list[str]:
    """What ``--help`` says of the options ``argv`` chooses: each one's keys (``section``), its
    composition's error, or, with no option chosen, how to ask for them."""
    from recipes.cli import normalize
    from recipes.compose import search_args

    search, rest = search_args([a for a in argv if a not in ("-h", "--help")])
    overrides, named = _requested(normalize([a for a in rest if "=" in a and not a.startswith("-")]))
    if not named:
        return [f"every key of an option, with its value and meaning: python {script} --help strategy=<preset> "
                "(or model=, cluster=, trainer=, data=, ...: any group above)"]
    lines = ["the keys of the options chosen (key=value as this command line composes it, and what it means):"]
    composed: dict[tuple[str, ...], Any] = {}  # (one composition for every option of one point)
    for group, option in named:
        point = (*search, *(o.partition("=")[0] + "=" + option if o.partition("=")[0].lstrip("+") == group
                            else o for o in overrides))
        if point not in composed:
            try:
                composed[point] = _composed(point)
            except Exception as e:  # noqa: BLE001  (a composition error: its own line, the rest still listed)
                from recipes.cli_help import composition_problems

                composed[point] = composition_problems(e, list(point)) or [f"{group}={option}: {str(e).splitlines()[0]}"]
                lines += ["", *composed[point]]
        if isinstance(composed[point], list):
            continue
        config, chosen = composed[point]
        for g, o, why in _shown_groups(group, option, chosen - {g for g, _ in named}, config):
            lines += ["", *section(g, o, config[g], why)]
    return lines


def _composed(point: tuple[str, ...]) -> tuple[dict, set[str]]:
    """(the config ``point`` composes, unresolved: ``${...}`` as written; the groups it chose)."""
    from omegaconf import OmegaConf

    from recipes.compose import compose_chosen

    cfg, chosen, _ = compose_chosen(list(point))
    return OmegaConf.to_container(cfg, resolve=False), chosen


def _shown_groups(group: str, option: str, chosen: set[str], config: dict) -> list[tuple[str, str, str]]:
    """(group, option, why) to list for ``group=option``: itself; for an experiment, the options
    of the other groups it chose (by their ``name``; ``chosen``: those the command line does not
    name). A group switched off has no keys."""
    if group not in NO_SCHEMA:
        picked = [(group, option, "")]
    else:
        picked = [(g, str(config[g].get("name", "?")) if isinstance(config.get(g), dict) else "?",
                   f"chosen by {group}={option}") for g in sorted(chosen - {group, *NO_SCHEMA})]
    return [p for p in picked if isinstance(config.get(p[0]), dict)]
