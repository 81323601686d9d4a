"""long_horizon: tens of turns in which a rule stated early must still hold at the end.

    env = make_env(EnvConfig(kind="long_horizon", options={"steps": 30, "constraint_turn": 12}), tokenizer=tok)

The environment plays the user in a counting game. Its first message sets a starting
total (and, with constraint_turn 0, a rule); the policy replies with the starting total.
Then, one per turn, it gives `steps` numbers to add or subtract ("Add 7.", "Subtract 3."),
and the policy replies with the new running total each time; with constraint_turn k > 0 the
rule arrives with the k-th number ("From now on, ..."). Last, it asks for the final total.
So the final answer comes steps + 2 policy turns after the start, and a rule from turn k
must still be kept tens of turns later.

Rules (options.constraints, drawn in turn): end_word (every reply ends with a given word),
no_letter (no reply uses a given letter, in either case), brackets (every reply is wrapped
in square brackets). A reply's total is the last integer in it.

Reward components, each judged in a reward worker (ptrain.envs.safety):
  correct     options.correct_reward if the final total is right;
  constraint  options.constraint_reward if the final reply keeps the rule;
  steps       options.steps_reward times the fraction of the other replies that are right
              and keep the rule if it had been stated by then.
An episode that ends before the final question (turn limit) scores 0 on correct and
constraint; one cut by a length limit is not scored unless env.score_truncated. Metrics:
correct, kept_rule, steps_right (the fraction), replies.
"""

from __future__ import annotations

import random
import re
from typing import Any

from ptrain.envs.multi_turn import MultiTurnEnv, Score

SYSTEM_PROMPT = (
    "You are playing a counting game with the user. Keep every rule the user gives for the whole "
    "conversation, in every reply, however long it gets."
)
_END_WORDS = ("banana", "indeed", "copper", "over", "lantern", "okay", "amen", "forward")
_LETTERS = ("e", "t", "a", "o", "s", "n")
_INT_RE = re.compile(r"-?\d+")


def rule_text(rule: dict[str, Any]) -> str:
    """The rule as the user states it."""
    if rule["kind"] == "end_word":
        return f'End every reply with the word "{rule["word"]}".'
    if rule["kind"] == "no_letter":
        return f'Never use the letter "{rule["letter"]}" (upper or lower case) in a reply.'
    return "Wrap every reply in square brackets, like [your reply]."


def keeps_rule(reply: str, rule: dict[str, Any]) -> bool:
    """Whether one reply keeps the rule."""
    if rule["kind"] == "end_word":
        words = re.findall(r"[a-z]+", reply.casefold())
        return bool(words) and words[-1] == rule["word"]
    if rule["kind"] == "no_letter":
        return rule["letter"] not in reply.casefold()
    text = reply.strip()
    return len(text) >= 2 and text[0] == "[" and text[-1] == "]"


def reply_total(reply: str) -> int | None:
    """The last integer in a reply, or None."""
    found = _INT_RE.findall(reply)
    return int(found[-1]) if found else None


def judge_final_total(replies: list[str], data: dict[str, Any]) -> float:
    """1.0 when the episode reached the final question and its answer's total is right."""
    totals = data["totals"]
    if len(replies) < len(totals):
        return 0.0
    return float(reply_total(replies[len(totals) - 1]) == totals[-1])


def judge_final_rule(replies: list[str], data: dict[str, Any]) -> float:
    """1.0 when the episode reached the final question and its answer keeps the rule."""
    if len(replies) < len(data["totals"]):
        return 0.0
    return float(keeps_rule(replies[len(data["totals"]) - 1], data["rule"]))


def judge_steps(replies: list[str], data: dict[str, Any]) -> float:
    """The fraction of replies before the final one that are right (and keep the rule once stated)."""
    totals = data["totals"][:-1]
    right = 0
    for i, want in enumerate(totals):
        if i < len(replies):
            ok = reply_total(replies[i]) == want
            # Reply i answers the env message i; the rule came with message constraint_turn.
            if ok and i >= data["constraint_turn"]:
                ok = keeps_rule(replies[i], data["rule"])
            right += ok
    return right / len(totals)


class LongHorizonEnv(MultiTurnEnv):
    """The long_horizon kind (module docstring)."""

    kind = "long_horizon"
    env_roles = ("user", "tool")
    component_names = ("correct", "constraint", "steps")
    metric_names = ("correct", "kept_rule", "steps_right", "replies")

    def make_tasks(self, seed: int):
        opts = self.options
        out = []
        for split, n in (("train", self.cfg.n_train), ("eval", self.cfg.n_eval)):
            rng = random.Random(f"long_horizon/{split}/{seed}")
            tasks = []
            for i in range(n):
                kind = opts.constraints[i % len(opts.constraints)]
                rule: dict[str, Any] = {"kind": kind}
                if kind == "end_word":
                    rule["word"] = rng.choice(_END_WORDS)
                elif kind == "no_letter":
                    rule["letter"] = rng.choice(_LETTERS)
                start = rng.randint(0, 50)
                totals, follow_ups, total = [start], [], start
                for _ in range(opts.steps):
                    k = rng.randint(1, opts.max_step)
                    if rng.random() < 0.5 or total - k < 0:
                        total += k
                        follow_ups.append(f"Add {k}.")
                    else:
                        total -= k
                        follow_ups.append(f"Subtract {k}.")
                    totals.append(total)
                totals.append(total)  # the final question's answer
                follow_ups.append("That was the last number. What is the final total?")
                if opts.constraint_turn:
                    j = opts.constraint_turn - 1
                    follow_ups[j] = f"From now on, a new rule: {rule_text(rule)} {follow_ups[j]}"
                opening = (
                    f"Let's keep a running total, starting at {start}. I will give you numbers one at a time; after "
                    "each, reply with the new total."
                )
                if not opts.constraint_turn:
                    opening += f" Rule: {rule_text(rule)}"
                opening += " To begin, reply with the starting total."
                messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": opening}]
                data = {"rule": rule, "totals": totals, "follow_ups": follow_ups,
                        "constraint_turn": opts.constraint_turn}  # fmt: skip
                tasks.append(self.task(split, i, messages, data))
            out.append(tasks)
        return out[0], out[1]

    async def env_response(self, task, state):
        sent = state.extra.get("sent", 0)
        follow_ups = task.data["follow_ups"]
        if sent >= len(follow_ups):
            return None
        state.extra["sent"] = sent + 1
        return [{"role": "user", "content": follow_ups[sent]}]

    async def score(self, task, state, workspace) -> Score:
        replies = [m["content"] for m in state.messages if m.get("role") == "assistant"]
        # Only replies that answered the game: a turn spent on a tool call is not one.
        replies = [r for r, t in zip(replies, self._policy_turn_kinds(state)) if t == "reply"]
        data = dict(task.data)
        parts, reasons = {}, []
        for name, fn in (("correct", judge_final_total), ("constraint", judge_final_rule), ("steps", judge_steps)):
            value, reason = await self.judge(fn, replies, data)
            parts[name] = value
            if reason:
                reasons.append(f"{name}: {reason}")
        o = self.options
        components = {
            "correct": o.correct_reward * parts["correct"],
            "constraint": o.constraint_reward * parts["constraint"],
            "steps": o.steps_reward * parts["steps"],
        }
        metrics = {"correct": parts["correct"], "kept_rule": parts["constraint"], "steps_right": parts["steps"],
                   "replies": float(len(replies))}  # fmt: skip
        return Score(components, metrics, "; ".join(reasons) or None)

    @staticmethod
    def _policy_turn_kinds(state) -> list[str]:
        """'reply' or 'tool_call' for each policy turn, from the audit turns that follow it."""
        kinds = []
        turns = state.turns
        for i, t in enumerate(turns):
            if t["role"] == "policy":
                nxt = turns[i + 1]["role"] if i + 1 < len(turns) else None
                kinds.append("tool_call" if nxt == "tool" else "reply")
        return kinds


__all__ = ["LongHorizonEnv", "judge_final_rule", "judge_final_total", "judge_steps", "keeps_rule", "rule_text"]
