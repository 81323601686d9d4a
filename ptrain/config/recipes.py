"""The recipes there are, and the check that a named one exists (no JAX, no Hydra compose).

A recipe is a YAML file of the Hydra group `recipe` (recipes/, shipped as
`ptrain.conf/recipe/`). Hydra's own message for a missing one is a traceback-sized dump of
its search path; the CLI and `ptrain.compose` check the name first and say which exist.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib import resources


def available_recipes() -> list[str]:
    """Names of the recipes shipped with ptrain, sorted."""
    folder = resources.files("ptrain.conf") / "recipe"
    if not folder.is_dir():
        return []
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def check_recipe(name: str) -> None:
    """ConfigError unless `name` is a shipped recipe; the message lists the recipes there are."""
    from ptrain.config.run import ConfigError

    known = available_recipes()
    if name in known:
        return
    close = [k for k in known if name and (name in k or k in name)]
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise ConfigError(
        f"config key 'recipe': there is no recipe '{name}'{hint}; pass one of {', '.join(known)} "
        "(recipes/ holds them; `python -m ptrain --help` lists every group)"
    )


def recipes_named(args: Iterable[str]) -> list[str]:
    """The recipe names a command line selects (`recipe=a`, or `recipe=a,b` in a sweep); empty
    when it names none, or when it extends Hydra's search path (a user's own recipe folder,
    which Hydra then checks itself)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    args = list(args)
    if any(a.lstrip("+~").startswith("hydra.searchpath") for a in args):
        return []
    parser = OverridesParser.create()
    names: list[str] = []
    for text in args:
        if text.startswith("-") or "=" not in text or text.lstrip("+~").split("=", 1)[0] != "recipe":
            continue
        try:
            override = parser.parse_override(text)
        except HydraException:
            continue  # Hydra reports its own grammar errors
        if override.is_delete():
            continue
        value = override.value()
        items = list(value.list) if hasattr(value, "list") else [value]
        names.extend(str(v) for v in items if v is not None)
    return names
