"""SFT rows from environments: the prompt as the environment renders it, the mixture by weight."""

from collections import Counter

from ptrain.config.env import EnvConfig
from ptrain.data.tokenizer import build_tokenizer
from ptrain.envs.demonstrations import demonstration_rows
from ptrain.envs.mixture import env_task_seed
from ptrain.envs.registry import make_env


def test_rows_show_the_prompt_the_environment_renders_and_follow_the_weights():
    tok = build_tokenizer()
    calculator = {"families": ["calculator"], "tools": ["calculator"]}
    tools = make_env(EnvConfig(kind="tool_use", n_train=6, n_eval=2, options=calculator), tokenizer=tok)
    mcqa = make_env(EnvConfig(kind="mcqa", n_train=6, n_eval=2), tokenizer=tok)
    train, held = demonstration_rows([tools, mcqa], [3.0, 1.0], n_train=200, n_eval=2, seed=0)

    by_env = Counter(r["env"] for r in train)
    assert 130 <= by_env["tool_use"] <= 170 and by_env["mcqa"] == 200 - by_env["tool_use"]
    assert [r["env"] for r in held] == ["tool_use", "tool_use", "mcqa", "mcqa"]
    assert all(r["task"].startswith("eval-") for r in held) and all(r["task"].startswith("train-") for r in train)

    row = next(r for r in train if r["env"] == "tool_use")
    task = next(t for t in tools.tasks("train", seed=env_task_seed(tools, 0)) if t.id == row["task"])
    demo = tools.demonstration(task)
    assert row["messages"][-len(demo) :] == demo
    # The prompt part renders to exactly the tokens the environment prompts the policy with,
    # tool declarations included.
    prompt = row["messages"][: -len(demo)]
    assert prompt[0]["role"] == "system" and '"calculator"' in prompt[0]["content"]
    text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    assert tok.encode(text, add_special_tokens=False) == tools.format.prompt_ids(task.messages)
