"""docs/recipes.md is what tools/recipes_table.py generates from the recipe files now, so the
page cannot drift from the recipes; and the header fields it reads are parsed as written."""

import pytest

from ptrain.config.recipes import available_recipes
from tools import recipes_table


def test_docs_recipes_md_is_what_the_tool_generates_now():
    with open(recipes_table.DOC) as f:
        page = f.read()
    assert page == recipes_table.render(), (
        "docs/recipes.md differs from what the recipe files give (a recipe, its header or a default changed); "
        f"regenerate it with: {recipes_table.COMMAND}"
    )


def test_every_recipe_header_says_what_it_reproduces_its_time_and_its_result():
    from importlib import resources

    for name in available_recipes():
        text = (resources.files("ptrain.conf") / "recipe" / f"{name}.yaml").read_text()
        fields = recipes_table.header_fields(text)
        for field in ("Reproduces", "Time", "Result"):
            assert fields.get(field), f"recipes/{name}.yaml: header lacks {field}:"
        lines = text.splitlines()
        time = next(i for i, line in enumerate(lines) if line.startswith("# Time:"))
        result = next(i for i, line in enumerate(lines) if line.startswith("# Result"))
        assert time < result, f"recipes/{name}.yaml: Time: comes after Result:"


def test_a_header_without_time_stops_the_table_naming_the_recipe_file():
    fields = recipes_table.header_fields("# Reproduces: a paper.\n# Result:     level.")
    with pytest.raises(recipes_table.HeaderError, match=r"recipes/x\.yaml: the header has no Time: field"):
        recipes_table.time_summary(fields, "x")
    timed = recipes_table.header_fields("# Time:       about 5 minutes at scale=tiny,\n#             alone.")
    assert recipes_table.time_summary(timed, "x") == "about 5 minutes at scale=tiny, alone."


def test_header_fields_join_continuations_and_stop_before_a_table():
    text = "\n".join([
        "# @package _global_",
        "# What it does.",
        "#",
        "# Reproduces: a paper (arXiv 1),",
        "#             with its settings.",
        "# Launch:     python -m ptrain recipe=x",
        "# Result:     accuracy, seed 0:",
        "#               step 0   0.1",
        "#",
        "# Result at scale=tiny: ignored, the first Result wins.",
        "defaults:",
        "# Reproduces: not in the header",
    ])  # fmt: skip
    fields = recipes_table.header_fields(text)
    assert fields["Reproduces"] == "a paper (arXiv 1), with its settings."
    assert fields["Result"] == "accuracy, seed 0:"
    assert recipes_table.first_sentence(fields["Result"], "x") == (
        "accuracy, seed 0; the numbers are in the header of recipes/x.yaml."
    )
    scaled = recipes_table.header_fields("# Result at scale=tiny: not measured yet.\n#   More. Text.")
    assert recipes_table.first_sentence(scaled["Result"], "x") == "at scale=tiny: not measured yet."


def test_a_first_sentence_runs_past_a_title_such_as_dr_grpo():
    text = "Dr. GRPO ends level with GRPO (0.576 against 0.579). Measured on three seeds."
    assert recipes_table.first_sentence(text, "x") == "Dr. GRPO ends level with GRPO (0.576 against 0.579)."
