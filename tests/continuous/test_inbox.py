"""The inbox: what becomes an environment, what is rejected (moved, with the reason beside it),
and the continuous config's own checks."""

from __future__ import annotations

import os
import re

import pytest

from ptrain.api import compose
from ptrain.config import ConfigError
from ptrain.continuous import inbox


def write(folder, name, text):
    path = folder / name
    path.write_text(text)
    return str(path)


def test_a_valid_file_is_an_arrival_named_by_its_file(tmp_path):
    write(tmp_path, "subtraction.yaml", "kind: arithmetic\nn_eval: 8\noptions: {ops: ['-']}\n")
    new, rejected = inbox.scan(str(tmp_path), {})
    assert rejected == [] and [a.name for a in new] == ["subtraction"]
    arrival = new[0]
    assert arrival.spec["name"] == "subtraction" and arrival.env_config().options["ops"] == ["-"]
    assert arrival.sha256 == inbox.spec_hash(arrival.spec)
    # Seen again with the same content: nothing new, nothing rejected, the file stays.
    assert inbox.scan(str(tmp_path), {"subtraction": arrival.sha256}) == ([], [])
    assert os.path.isfile(tmp_path / "subtraction.yaml")


@pytest.mark.parametrize(
    ("name", "text", "reason"),
    [
        ("bad_kind.yaml", "kind: nonsense\n", "envs.bad_kind.kind': unknown environment kind 'nonsense'"),
        ("bad_op.yaml", "kind: arithmetic\noptions: {ops: ['/']}\n", "envs.bad_op.options.ops"),
        ("bad_key.yaml", "kind: arithmetic\nn_evals: 3\n", "n_evals"),
        ("bad_type.yaml", "kind: arithmetic\nn_eval: many\n", "n_eval"),
        ("not_a_map.yaml", "- kind: arithmetic\n", "not a mapping"),
        ("broken.yaml", "kind: [arithmetic\n", "not valid YAML"),
        ("notes.txt", "kind: arithmetic\n", "is not a .yaml file"),
        ("renamed.yaml", "kind: arithmetic\nname: other\n", "named by its file"),
    ],
)
def test_bad_files_move_to_rejected_with_the_reason(tmp_path, name, text, reason):
    write(tmp_path, name, text)
    write(tmp_path, "good.yaml", "kind: arithmetic\n")
    new, rejected = inbox.scan(str(tmp_path), {})
    assert [a.name for a in new] == ["good"]  # one bad file stops nothing else
    ((moved, why),) = rejected
    assert moved == str(tmp_path / "rejected" / name) and os.path.isfile(moved)
    assert not os.path.exists(tmp_path / name)
    assert reason in why
    assert open(moved + ".error").read().strip() == why


def test_a_known_name_with_other_content_is_rejected(tmp_path):
    write(tmp_path, "math.yaml", "kind: arithmetic\nn_eval: 8\n")
    new, rejected = inbox.scan(str(tmp_path), {"math": "0" * 64})
    assert new == [] and "already in the run with other content" in rejected[0][1]


def test_hidden_and_error_files_and_folders_are_not_read(tmp_path):
    write(tmp_path, ".partial.yaml", "kind: [")
    (tmp_path / "rejected").mkdir()
    write(tmp_path / "rejected", "old.yaml", "kind: nonsense")
    assert inbox.scan(str(tmp_path), {}) == ([], [])
    with pytest.raises(FileNotFoundError, match="mkdir -p"):
        inbox.scan(str(tmp_path / "missing"), {})


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("continuous.replay=1.0", "continuous.replay"),
        ("continuous.margin=-0.1", "continuous.margin"),
        ("continuous.confidence=1.5", "continuous.confidence"),
        ("continuous.bootstrap_samples=10", "continuous.bootstrap_samples"),
        ("continuous.improve=most", "continuous.improve"),
        ("continuous.max_rounds=0", "continuous.max_rounds"),
        ("continuous.tripwires.length_ratio=0.5", "continuous.tripwires.length_ratio"),
        ("continuous.tripwires.kl=-1", "continuous.tripwires.kl"),
        ("continuous.trigger.drop=0", "continuous.trigger.drop"),
        ("continuous.serve_urls=[localhost:30000]", "continuous.serve_urls[0]"),
    ],
)
def test_bad_continuous_values_name_the_key(tmp_path, override, key):
    with pytest.raises(ConfigError, match=re.escape(f"config key '{key}'")):
        compose("continuous", [f"continuous.inbox={tmp_path}", override])


def test_the_recipe_needs_an_inbox_and_a_final_grpo_stage(tmp_path):
    with pytest.raises(ConfigError, match="continuous.inbox"):
        compose("continuous")
    with pytest.raises(ConfigError, match="must be its last stage"):
        compose("sft_grpo_arithmetic", ["continuous.enabled=true", f"continuous.inbox={tmp_path}"])
    import ptrain

    with pytest.raises(ConfigError, match="ptrain.continuous"):
        ptrain.run("continuous", [f"continuous.inbox={tmp_path}"])
