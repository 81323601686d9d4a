"""docs/recipes.md: one table of every recipe, generated from the recipe files.

    python tools/recipes_table.py            # print the page
    python tools/recipes_table.py --write    # write docs/recipes.md
    python tools/recipes_table.py --check    # exit 1 when docs/recipes.md differs

Each recipe is composed as `ptrain.compose(name)` (the recipe as written, scale tiny) for its
stages, each stage's algorithm (its merged config, `ptrain.config.stage_config`) and the
environments its sampling stages use. What it reproduces, its time and its result are read
from the header comment: the `Reproduces:` field, the `Time:` field (the wall time of the
default run, scale tiny, as the Result states it) and the first sentence of the `Result:` (or
`Result at scale=...:`) field. A field runs on over the comment lines indented below it. A
header without a `Time:` field stops the tool with an error that names the recipe file.
Nothing is run, downloaded or measured here; tests/test_recipes_doc.py keeps the page equal
to what this prints.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from importlib import resources

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "recipes.md")
COMMAND = "python tools/recipes_table.py --write"

_FIELD = re.compile(r"^# (\w[\w ]*?)( at scale=\S+)?:\s*(.*)$")
_CONTINUED = re.compile(r"^#\s{2,}(\S.*)$")


def header_fields(text: str) -> dict[str, str]:
    """{field name: its text, continuation lines joined and whitespace collapsed} of the
    comment block a recipe file opens with. A field is a line `# Name: text` (or `# Name at
    scale=S: text`); it runs on over the following comment lines indented by two spaces or
    more, and ends at a blank comment line, a line of ordinary prose, the first non-comment
    line, or after a line that ends in ':' (what follows it is a table). A field's `at
    scale=S` stays at the front of its text."""
    fields: dict[str, str] = {}
    name: str | None = None
    parts: list[str] = []
    table = False

    def close() -> None:
        if name is not None and name not in fields:
            fields[name] = " ".join(" ".join(parts).split())

    for line in text.splitlines():
        if not line.startswith("#"):
            break
        field = _FIELD.match(line)
        more = _CONTINUED.match(line)
        if name is not None and more and not field:
            if not table:
                parts.append(more.group(1))
                table = line.rstrip().endswith(":")
            continue
        close()
        name, parts, table = None, [], False
        if field:
            scale = field.group(2)  # "Result at scale=tiny:" keeps its scale: "at scale=tiny: ..."
            parts = [f"{scale.strip()}: {field.group(3)}" if scale else field.group(3)]
            name, table = field.group(1), line.rstrip().endswith(":")
    close()
    return fields


def first_sentence(text: str, recipe: str) -> str:
    """The text up to its first sentence end (a '.' before a space or the end, not the one of
    a title such as "Dr. GRPO"). A text that ends in ':' before any sentence end introduces a
    table, which stays in the header: it says so instead."""
    end = re.search(r"(?<!\bDr)\.(\s|$)", text)
    if end is not None:
        return text[: end.start() + 1]
    if text.endswith(":"):
        return text[:-1] + f"; the numbers are in the header of recipes/{recipe}.yaml."
    return text


def result_summary(fields: dict[str, str], recipe: str) -> str:
    """The Result field's first sentence, or what the header lacks."""
    text = fields.get("Result")
    if not text:
        return "(no Result line in the header)"
    return first_sentence(text, recipe)


class HeaderError(ValueError):
    """A recipe header lacks a field the page needs."""


def time_summary(fields: dict[str, str], recipe: str) -> str:
    """The Time field as written; a header without one is an error (every recipe states its
    wall time at scale=tiny, or that it was not timed)."""
    text = fields.get("Time")
    if not text:
        raise HeaderError(
            f"recipes/{recipe}.yaml: the header has no Time: field (the wall time of the recipe's "
            "default run at scale=tiny as its Result states it, or 'not timed' and what is known), "
            "placed before the Result field"
        )
    return text


def _number(x: float) -> str:
    return f"{x:g}"


def grpo_algorithm(g) -> str:
    """A GRPO-family stage's algorithm: the name its settings match (ptrain/config/grpo.py's
    presets), then the settings that tell the family apart."""
    if g.objective == "cispo":
        name = "CISPO"
    elif g.ratio_level == "sequence":
        name = "GSPO"
    elif g.aggregation == "seq_mean_token_sum_norm" and not g.normalize_std:
        name = "Dr. GRPO"
    elif g.dynamic_sampling:
        name = "DAPO"
    else:
        name = "GRPO"
    high = g.clip_low if g.clip_high is None else g.clip_high
    knobs = [
        f"{g.ratio_level} ratio clip {_number(g.clip_low)}/{_number(high)}",
        g.aggregation,
        f"{g.baseline} baseline" + ("/std" if g.normalize_std else ", no std"),
        f"KL {_number(g.kl_coef)}" + (f" ({g.kl_estimator})" if g.kl_coef else ""),
    ]
    if g.dynamic_sampling:
        knobs.append("dynamic sampling")
    if g.overlong_filter:
        knobs.append("overlong filter")
    if g.overlong_buffer:
        knobs.append(f"overlong penalty over {g.overlong_buffer} tokens")
    if g.epochs * g.mini_batches > 1:
        knobs.append(f"{g.epochs * g.mini_batches} updates a rollout")
    return f"{name} ({', '.join(knobs)})"


def stage_algorithm(run, stage) -> str | None:
    """What a stage trains with, from its merged config; None for eval."""
    from ptrain.config import stage_config

    cfg = stage_config(run, stage)
    if stage.kind == "sft":
        return f"SFT ({cfg.algo.sft.aggregation})"
    if stage.kind == "dpo":
        return f"DPO ({cfg.algo.dpo.kind}, beta {_number(cfg.algo.dpo.beta)})"
    if stage.kind == "grpo":
        return grpo_algorithm(cfg.algo.grpo)
    if stage.kind == "rm":
        return "reward model"
    return None


def recipe_row(name: str) -> list[str]:
    """[name, stages, algorithm, environments, time at tiny, objective, reproduces, result] of
    one recipe."""
    import ptrain
    from ptrain.config.stages import STAGES

    try:
        run = ptrain.compose(name)
    except ptrain.ConfigError as e:
        if "continuous.inbox" not in str(e):
            raise
        run = ptrain.compose(name, ["continuous.inbox=INBOX"])  # a loop's inbox is the launch's to give
    stages = ", ".join(f"{s.name} ({s.kind})" for s in run.stages)
    algos = [(s.name, stage_algorithm(run, s)) for s in run.stages]
    algos = [(n, a) for n, a in algos if a is not None]
    if len(algos) == 1:  # one training stage: its algorithm alone, without the stage's name
        algorithm = algos[0][1]
    else:
        algorithm = "; ".join(f"{n}: {a}" for n, a in algos) or "-"
    envs: list[str] = []
    for s in run.stages:
        if STAGES[s.kind].samples:
            envs += [e for e in (s.envs or sorted(run.envs)) if e not in envs]
    text = (resources.files("ptrain.conf") / "recipe" / f"{name}.yaml").read_text()
    fields = header_fields(text)
    reproduces = fields.get("Reproduces") or "(no Reproduces line in the header)"
    time = time_summary(fields, name)
    objective = f"`{run.objective}`" if run.objective else "-"
    return [
        f"`{name}`",
        stages,
        algorithm,
        ", ".join(envs) or "-",
        time,
        objective,
        reproduces,
        result_summary(fields, name),
    ]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    """The whole of docs/recipes.md."""
    from ptrain.config.recipes import available_recipes

    lines = [
        "# Recipes",
        "",
        "Every recipe in `recipes/`, composed as written (scale tiny, the CPU size). Each recipe's",
        "header holds its launch lines, its settings next to the published ones with sources, and",
        "what it does not reproduce; `scale=smoke` runs every stage for a few steps (CI) and",
        "`scale=published` holds the paper's settings where a recipe has them. The time column is",
        "the wall time of the recipe's default run (scale tiny) as its header states it, with the",
        "machine and whether other runs shared it.",
        "",
        f"Generated from the recipe files by `{COMMAND}`;",
        "tests/test_recipes_doc.py fails when this page and the recipes disagree.",
        "",
        "| recipe | stages (kind) | algorithm | environments | time at tiny | objective | reproduces | result |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in available_recipes():
        lines.append("| " + " | ".join(_cell(c) for c in recipe_row(name)) + " |")
    lines += [
        "",
        "## Sweeps and searches",
        "",
        "`python -m ptrain -m recipe=dapo algo.grpo.clip_high=0.2,0.28` runs one job per value, each in",
        "its own folder under the sweep folder (`hydra.sweep.dir`), and ends with a table of every",
        "job's overrides and the final metrics of its last stage, also written there as",
        "`sweep_summary.jsonl`. A job that fails does not stop the others. Each recipe's header names",
        "the sweeps over the knobs its paper studies.",
        "",
        '`pip install ".[search]"` adds Hydra\'s optuna sweeper, which searches instead of listing:',
        "",
        "```",
        "python -m ptrain -m recipe=countdown_zero hydra/sweeper=optuna hydra.sweeper.direction=maximize \\",
        "    hydra.sweeper.n_trials=20 'algo.grpo.clip_high=interval(0.2,0.4)' 'algo.grpo.group_size=choice(4,8)'",
        "```",
        "",
        "Each trial returns the recipe's `objective` (the column above: one of the last stage's final",
        "metrics; `objective=KEY` picks another) and the best trial is written to",
        "`optimization_results.yaml` in the sweep folder. A search without an objective, or with one",
        "the last stage does not report, stops at its first trial and says which keys there are. So",
        "does a trial whose sampled settings are not a valid config (narrow the space). A trial that",
        "fails while training (a loss that turns NaN) ends the search with its reason, as optuna's",
        "default `hydra.sweeper.max_failure_rate=0.0` asks; with `max_failure_rate=1.0` it is a failed",
        "trial and the search goes on, and when every trial failed it ends with their reasons.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"write {os.path.relpath(DOC, ROOT)}")
    mode.add_argument("--check", action="store_true", help=f"exit 1 when {os.path.relpath(DOC, ROOT)} differs")
    args = parser.parse_args(argv)
    try:
        page = render()
    except HeaderError as e:
        print(e, file=sys.stderr)
        return 1
    if args.write:
        with open(DOC, "w") as f:
            f.write(page)
        return 0
    if args.check:
        have = open(DOC).read() if os.path.exists(DOC) else ""
        if have != page:
            print(f"{os.path.relpath(DOC, ROOT)} is out of date; regenerate it with: {COMMAND}", file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
