"""Seconds per GRPO step of ptrain on this machine, beside TRL's GRPOTrainer in the same sitting.

    python tools/bench_grpo.py                            # sync, then async (one process each)
    python tools/bench_grpo.py --with-trl /tmp/peers      # then TRL's bench_trl_grpo.py 4 64, and the ratios
    python tools/bench_grpo.py --with-trl /tmp/peers --rounds 2   # sync, async, TRL, sync, async, TRL
    python tools/bench_grpo.py --mode sync --steps 3      # one mode, in this process
    python tools/bench_grpo.py --small --mode sync        # a 2-layer d128 model (smoke)

The shape of TRL's script (../shared/peers/bench_trl_grpo.py): the 8-layer d512 Qwen3 of
tools/bench_model.py in float32; 8 prompts (16 random words, about one in seven a number,
in the chat template) x 8 samples of at most 64 new tokens at temperature 1, each stopping
at the end-of-turn token as TRL's do (from random weights nearly all run to 64); reward = the
share of digit characters in the decoded completion; beta 0 (no reference model); one AdamW
step per rollout batch at lr 1e-6, token-mean loss (TRL's default "dapo" aggregation).
With --with-trl the tokenizer is the peers' (PEERS_DIR/models/tokenizer), so both sides see
the same prompt lengths; otherwise the embedded one at the model's 4096-token vocabulary.

What is timed is the stage's own code, built as run_grpo_stage builds it and driven as
train_loop drives it: RolloutBatches (RolloutCollector over LocalEngine, group advantages,
policy_batch), the jitted step of make_policy_objective (build_step), the weight push after
every step; only checkpoints, evaluation and the metric sinks are left out. The environment
is a SingleTurnEnv subclass defined here (its own tasks and `score`). Modes: sync, and async
with max_staleness 1 (the collector keeps two rollout batches in flight, weights swapped in
place). Each step is split, as the trainer's thread sees it, into

  generate   waiting for the rollout batch, less the reward time (sync); in async mode the
             engine runs beside training and this wait is the trainer's `idle` time
  reward     the environment's `score` calls (in async mode they overlap training)
  batch      advantages, policy_batch and the stage's metrics
  train      the jitted optimizer step (forward, backward, AdamW), waited for
  sync       the weight push to the engine (after_step)

and the median over the timed steps is printed with tokens/s, the step's floor (generation
FLOPs + training FLOPs at the float32 matmul rate measured in the same run, and the weights
and KV-cache bytes of decoding at the measured memory rate) and the peak RSS. TRL's peak RSS
is its process's, from wait4.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ptrain.runtime import reexec_with_malloc_tuning, tune_xla_cpu  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER_SCRIPTS = os.path.join(os.path.dirname(REPO), "shared", "peers")

# Words of the prompts: plain English and the vocabulary of RL for maths, as in TRL's script.
WORDS = (
    "the a of to and in is it for on was with as by at from this that be or are not have an "
    "model data train token learn policy reward value loss step batch number answer question "
    "sum product prime even odd seven twelve hundred gradient sequence compute"
).split()
NUMBER_SHARE = 0.15


def random_words(rng: random.Random, n: int) -> str:
    """n words, each a number in [0, 9999] with probability NUMBER_SHARE, else one of WORDS."""
    return " ".join(str(rng.randint(0, 9999)) if rng.random() < NUMBER_SHARE else rng.choice(WORDS) for _ in range(n))


def digit_share(text: str) -> float:
    """Share of digit characters in text (0 for an empty text): the reward of TRL's script."""
    return sum(ch.isdigit() for ch in text) / max(len(text), 1)


def _digit_share_env_class():
    from ptrain.envs.base import Task
    from ptrain.envs.single_turn import Score, SingleTurnEnv

    class DigitShareEnv(SingleTurnEnv):
        """Prompts of 16 random words; reward = the completion's share of digit characters,
        computed inline (no reward worker: TRL's reward function runs in its trainer too).
        `reward_seconds` adds up the time spent in `score`."""

        kind = "digit_share"
        words_per_prompt = 16

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.reward_seconds = 0.0

        def make_tasks(self, seed: int) -> tuple[list[Task], list[Task]]:
            rng = random.Random(seed)

            def make(split: str, n: int) -> list[Task]:
                return [self.task(split, i, self.user(random_words(rng, self.words_per_prompt)), {}) for i in range(n)]

            return make("train", self.cfg.n_train), make("eval", self.cfg.n_eval)

        async def score(self, task: Task, text: str) -> Score:
            t = time.perf_counter()
            out = self.scored(True, digit_share(text))
            self.reward_seconds += time.perf_counter() - t
            return out

    return DigitShareEnv


# ----------------------------------------------------------------------------- config


def bench_overrides(args, mode: str, run_dir: str) -> list[str]:
    """Hydra overrides of the benchmark's run, as a user would pass them on the command line."""
    from tools.bench_engine import SMALL
    from tools.bench_model import DENSE

    model = SMALL if args.small else DENSE
    out = ["stages=[{name: grpo, kind: grpo}]", "env=arithmetic", f"run_dir={run_dir}"]
    for f in dataclasses.fields(model):
        v = getattr(model, f.name)
        if f.name in ("seed", "hf_path") or not isinstance(v, bool | int | float | str | type(None)):
            continue
        out.append(f"model.{f.name}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}")
    tok = args.tokenizer
    out += [f"data.tokenizer_path={tok}" if tok else "data.tokenizer_path=null"]
    out += [f"data.tokenizer_vocab_size={model.vocab_size}"]
    out += [
        f"train.steps={args.warmup + args.steps + 1}",
        f"train.grad_accum={args.grad_accum}",
        "train.eval_every=0",
        "train.eval_batches=0",
        "train.eval_generate=0",
        f"algo.grpo.prompts_per_step={args.prompts}",
        f"algo.grpo.group_size={args.group}",
        f"algo.grpo.max_new_tokens={args.new_tokens}",
        "algo.grpo.temperature=1.0",
        "algo.grpo.kl_coef=0.0",
        "algo.grpo.aggregation=token_mean",
        f"algo.grpo.mode={mode}",
        *(["algo.grpo.max_staleness=1"] if mode == "async" else []),  # sync mode refuses the key
        "optim.lr=1e-6",
        "optim.schedule=constant",
        "optim.b2=0.999",
        f"rollout.max_running_requests={args.prompts * args.group}",
        f"rollout.decode_steps={args.decode_steps}",
        "envs.arithmetic.n_train=256",
        "envs.arithmetic.n_eval=8",
        "envs.arithmetic.score_truncated=true",
        "logging.console=false",
        "logging.tensorboard=false",
        *args.override,
    ]
    return out


def compose_run(overrides: list[str]):
    from hydra import compose, initialize_config_module

    from ptrain.config import register_configs, to_run_config

    register_configs()
    with initialize_config_module(config_module="ptrain.conf", version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=overrides))


# ----------------------------------------------------------------------------- floors


def matmul_weights(cfg) -> int:
    """Weights a token's forward multiplies by: every matmul, the output head included."""
    from ptrain.models import count_params

    norms = cfg.n_layers * (2 * cfg.d_model + (cfg.qk_norm and 2 * cfg.head_dim)) + cfg.d_model
    return count_params(cfg, active=True, embedding=False) - norms + cfg.vocab_size * cfg.d_model


def rows_of(batch: dict) -> list[tuple[int, int]]:
    """(prompt tokens, response tokens) of every real row of a policy batch: a row holds
    prompt + response - 1 tokens (the last one is only a target), the response's in the loss."""
    seg = (batch["segment_ids"] > 0).sum(axis=1)
    out = batch["loss_mask"].sum(axis=1)
    return [(int(s - o + 1), int(o)) for s, o in zip(seg, out) if s > 0]


def step_floor(cfg, prompt_lens: list[int], output_lens: list[int], group: int, gflops: float, gbs: float) -> dict:
    """Lower bounds on one step's time from its work: FLOPs at the matmul rate, bytes at the
    memory rate, for generation (one prefill per prompt, every sampled token decoded) and for
    training (forward + backward over every real token, then AdamW).

    FLOPs per token: 2 N (forward matmuls, N = matmul weights) plus causal attention, 4 x
    layers x heads x head_dim x (keys attended); training 3x the forward. Bytes: every decode
    call (one per output position, all rows at once) reads the weights and the rows' keys and
    values; training reads the weights forward and backward, writes gradients, and AdamW
    reads and writes params and both moments (10 N floats). Activations are left out: the
    floor is what no implementation can avoid."""
    n = matmul_weights(cfg)
    attn = 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim
    kv_bytes_per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4
    gen_flops = train_flops = 0.0
    gen_bytes = 0.0
    for i, P in enumerate(prompt_lens):
        if i % group == 0:  # a group's samples share one prefill of the prompt (all but its last token)
            gen_flops += sum(2 * n + attn * (t + 1) for t in range(P - 1))
        O = output_lens[i]
        gen_flops += sum(2 * n + attn * (P + t) for t in range(O))
        train_flops += 3 * sum(2 * n + attn * (t + 1) for t in range(P + O - 1))
    longest = max(output_lens) if output_lens else 0
    for t in range(longest):  # decode call t: weights once, the KV of every row still running
        running = [P for P, O in zip(prompt_lens, output_lens) if O > t]
        gen_bytes += n * 4 + kv_bytes_per_token * sum(P + t for P in running)
    gen_bytes += (len(prompt_lens) // group) * n * 4  # each prefill reads the weights once
    train_bytes = (2 + 1 + 7) * n * 4
    gen_s = max(gen_flops / (gflops * 1e9), gen_bytes / (gbs * 1e9))
    train_s = max(train_flops / (gflops * 1e9), train_bytes / (gbs * 1e9))
    return {
        "gen_gflop": gen_flops / 1e9,
        "train_gflop": train_flops / 1e9,
        "flop_floor_s": (gen_flops + train_flops) / (gflops * 1e9),
        "gen_gbyte": gen_bytes / 1e9,
        "train_gbyte": train_bytes / 1e9,
        "byte_floor_s": (gen_bytes + train_bytes) / (gbs * 1e9),
        "floor_s": gen_s + train_s,
        "gen_floor_s": gen_s,
        "train_floor_s": train_s,
    }


# ----------------------------------------------------------------------------- one mode, in process


def machine_rates(small: bool) -> tuple[float, float]:
    """(float32 GFLOP/s of a 2048^2 matmul, the better of this process's XLA flags and XLA's
    defaults; GB/s of reading 512 MiB), as tools/bench_engine.py and bench_train.py measure them.
    With `small`, tiny arrays in this process only (a smoke run's floor means nothing)."""
    from tools.bench_engine import matmul_rate, memory_rate
    from tools.bench_train import best_matmul_peak

    if small:  # smoke runs: this process's flags only, small arrays
        return matmul_rate(256, reps=2), memory_rate(16, reps=2)
    return best_matmul_peak(2048) / 1e9, memory_rate(512)


def run_mode(args, mode: str) -> dict:
    """Build the GRPO stage's pieces for `mode` and time warmup + steps optimizer steps."""
    import jax
    import numpy as np

    from ptrain.config import stage_config
    from ptrain.config.env import validate_env_config
    from ptrain.config.seeds import component_seed
    from ptrain.envs.mixture import EnvMixture
    from ptrain.metrics import to_host
    from ptrain.parallel import batch_sharding
    from ptrain.rollout.engines import make_engine
    from ptrain.rollout.protocol import SamplingParams
    from ptrain.stages.grpo import RolloutBatches, groups_ahead
    from ptrain.stages.grpo.collector import RolloutCollector
    from ptrain.stages.loop import Algorithm, build_step
    from ptrain.stages.setup import setup_stage, tokenizer_for
    from ptrain.train.policy_objective import make_policy_objective, policy_denominator

    with tempfile.TemporaryDirectory() as run_dir:
        run = compose_run(bench_overrides(args, mode, run_dir))
        stage_dir = os.path.join(run_dir, "stages", "grpo")
        os.makedirs(stage_dir)
        tokenizer = tokenizer_for(run, None)
        env_cfg = run.envs["arithmetic"]
        env = _digit_share_env_class()(env_cfg, validate_env_config(env_cfg), tokenizer=tokenizer)
        seed = component_seed(run, "train.seed")
        tasks = EnvMixture([env], [1.0], seed=seed, task_seeds={env.name: seed})
        prompt_lens = [len(env.prompt_ids(t)) for t in env.tasks("train", seed=seed)]
        # Rows as long as the longest prompt plus the response budget (TRL pads to its batch's longest).
        run.train.seq_len = -(-(max(prompt_lens) + args.new_tokens) // 8) * 8
        run = stage_config(run, run.stages[0])
        cfg = run.algo.grpo

        t0 = time.perf_counter()
        stage = setup_stage(run, stage_dir, None, tokenizer, kind="grpo", t_start=time.time())
        placed = stage.placed
        engine = make_engine(run, placed.model_def, placed.state.params, placed.state.model_state, mesh=placed.mesh,
                             tokenizer=tokenizer, seed=seed, stage_dir=stage_dir)  # fmt: skip
        sampling = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                  top_k=cfg.top_k)  # fmt: skip
        collector = RolloutCollector({env.name: env}, tasks, engine, sampling, group_size=cfg.group_size, seed=seed,
                                     ahead=groups_ahead(cfg))  # fmt: skip
        from ptrain.config.cost import cpu_cores

        hour_usd = run.cost.machine_hour_usd(jax.default_backend(), jax.device_count(), cpu_cores())
        batches = RolloutBatches(stage, collector, engine, costs=run.cost, hour_usd=hour_usd)
        algorithm = Algorithm(
            objective=make_policy_objective(placed.model_def, cfg, vocab_chunk=run.train.vocab_chunk),
            denominator=policy_denominator(cfg.aggregation, packed=cfg.pack_rows),
            finalize=batches.finalize,
            tokens_in=lambda b: int(np.sum(b["segment_ids"] > 0)),
        )
        step_fn = build_step(stage, algorithm)
        sharding = batch_sharding(placed.mesh)
        setup_s = time.perf_counter() - t0
        # The machine's rates before and after the steps (other jobs come and go); the floor
        # takes the faster of each, so it stays a lower bound.
        rates_before = machine_rates(args.small)

        records = []
        state = placed.state
        try:
            batches.begin(0, state)
            for step in range(1, run.train.steps + 1):
                reward0 = env.reward_seconds
                t_start, c_start = time.perf_counter(), time.process_time()
                batch = next(batches)
                t_batch, c_batch = time.perf_counter(), time.process_time()
                state, metrics = step_fn(state, jax.device_put(batch, sharding))
                jax.block_until_ready(metrics)
                t_train, c_train = time.perf_counter(), time.process_time()
                batches.after_step(step, state, metrics)
                t_sync = time.perf_counter()
                host = batches.finalize(to_host(metrics))
                t_end, c_end = time.perf_counter(), time.process_time()
                # The stage's own split of its rollout wait (named per mode in newer stages).
                waited = host.get("time/generate_s", host.get("time/rollout_wait_s"))
                reward = env.reward_seconds - reward0
                rec = {
                    "step": step,
                    "step_s": t_end - t_start,
                    "generate_s": waited - reward if mode == "sync" else 0.0,
                    "reward_s": reward,
                    "idle_s": waited if mode == "async" else 0.0,
                    "batch_s": t_batch - t_start - waited + (t_end - t_sync),
                    "train_s": t_train - t_batch,
                    "sync_s": t_sync - t_train,
                    # CPU seconds of every thread of this process over the rollout wait, the
                    # train step and the whole step: busy cores = CPU seconds / wall seconds.
                    "rollout_cpu_s": c_batch - c_start,
                    "train_cpu_s": c_train - c_batch,
                    "step_cpu_s": c_end - c_start,
                    "dropped_stale_groups": host["dropped_stale_groups"],
                    "loss": host["loss"],
                    "reward": host["reward/mean"],
                    "output_tokens": host["tokens/output"],
                    "prompt_tokens": host["tokens/prompt_uncached"] + host["tokens/prompt_cached"],
                    "response_length": host["response_length/mean"],
                    "truncated_frac": host["truncated_frac"],
                    "staleness_max": host["staleness/max"],
                    "train_tokens": algorithm.tokens_in(batch),
                    "rows": rows_of(batch),
                }
                records.append(rec)
                print(json.dumps({"mode": mode, **{k: round(v, 4) for k, v in rec.items() if k != "rows"}}), flush=True)
        finally:
            # Async episodes still waiting on the engine are dropped with the collector's loop;
            # asyncio's "Task was destroyed but it is pending" lines say only that.
            logging.getLogger("asyncio").setLevel(logging.CRITICAL)
            collector.close()
            engine.close()
            env.close()
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

    timed = records[args.warmup + 1 :]  # the first step compiles; then warmup steps
    med = {k: statistics.median(r[k] for r in timed) for k in timed[0] if k not in ("step", "rows")}
    rates_after = machine_rates(args.small)
    gflops, gbs = (max(a, b) for a, b in zip(rates_before, rates_after))
    floors = [step_floor(run.model, *zip(*r["rows"]), args.group, gflops, gbs) for r in timed]
    floor = {k: statistics.median(f[k] for f in floors) for k in floors[0]}
    return {
        "side": "ptrain",
        "mode": mode,
        "steps_timed": len(timed),
        "median": med,
        "steps": records,
        "compile_step_s": records[0]["step_s"],
        "setup_s": setup_s,
        "seq_len": run.train.seq_len,
        "grad_accum": run.train.grad_accum,
        "prompt_tokens_mean": med["prompt_tokens"] / (args.prompts * args.group),
        "matmul_gflops": gflops,
        "memory_gbs": gbs,
        "matmul_gflops_before_after": [rates_before[0], rates_after[0]],
        "memory_gbs_before_after": [rates_before[1], rates_after[1]],
        "floor": floor,
        "peak_rss_gib": peak_rss,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


# ----------------------------------------------------------------------------- TRL, in its own venv


def run_trl(peers_dir: str, scripts: str, steps: int, new_tokens: int) -> dict:
    """TRL's bench_trl_grpo.py in the peers' venv (set-up as its README says), in PEERS_DIR;
    returns its results JSON with the process's peak RSS (GiB) added."""
    py = os.path.join(peers_dir, "venv", "bin", "python")
    if not os.path.isfile(py):
        raise SystemExit(
            f"--with-trl {peers_dir}: no {py}; create the peers' venv as {scripts}/README.md says "
            f"(python3 -m venv {peers_dir}/venv; pip install torch==2.13.0; pip install -c constraints.txt ...)"
        )
    env = dict(os.environ, PEERS_DIR=peers_dir, PYTHONPATH=scripts, TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="2", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONWARNINGS="ignore")  # fmt: skip
    for k in ("XLA_FLAGS", "GLIBC_TUNABLES"):  # ours, not theirs
        env.pop(k, None)
    models = os.path.join(peers_dir, "models", "qwen3_small", "model.safetensors")
    if not os.path.isfile(models):
        subprocess.run([py, os.path.join(scripts, "make_models.py")], env=env, cwd=peers_dir, check=True)
    os.makedirs(os.path.join(peers_dir, "logs"), exist_ok=True)
    log_path = os.path.join(peers_dir, "logs", "trl_grpo_bench.log")
    with open(log_path, "w") as log:
        p = subprocess.Popen([py, os.path.join(scripts, "bench_trl_grpo.py"), str(steps), str(new_tokens)], env=env,
                             cwd=peers_dir, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise SystemExit(f"TRL's bench_trl_grpo.py exited {p.returncode}; log {log_path}:\n{tail}")
    with open(os.path.join(peers_dir, "results", f"trl_grpo_qwen3_small_c{new_tokens}.json")) as f:
        out = json.load(f)
    out["peak_rss_gib"] = usage.ru_maxrss / 2**20
    return out


def rates_in_subprocess(args) -> tuple[float, float]:
    """machine_rates in a fresh process (the driver itself never starts JAX)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--rates-only"] + (["--small"] if args.small else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return tuple(json.loads(out.strip().splitlines()[-1]))


def floor_at(floor: dict, gflops: float, gbs: float) -> float:
    """step_floor's floor_s for the same work at other rates."""
    gen = max(floor["gen_gflop"] / gflops, floor["gen_gbyte"] / gbs)
    train = max(floor["train_gflop"] / gflops, floor["train_gbyte"] / gbs)
    return gen + train


def trl_summary(r: dict) -> dict:
    """Median step and the parts TRL's script records, and the completion lengths it logged."""
    brk = {k: v["median"] for k, v in r.get("breakdown", {}).items()}
    lengths = [x["completions/mean_length"] for x in r.get("logs", []) if "completions/mean_length" in x]
    clipped = [x["completions/clipped_ratio"] for x in r.get("logs", []) if "completions/clipped_ratio" in x]
    return {
        "side": "trl",
        "step_s": r["median"],
        "step_times": r["all"],
        "breakdown_s": brk,
        "completion_length_mean": statistics.mean(lengths) if lengths else None,
        "clipped_ratio_mean": statistics.mean(clipped) if clipped else None,
        "peak_rss_gib": r["peak_rss_gib"],
    }


# ----------------------------------------------------------------------------- driver


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def print_mode(r: dict) -> None:
    m, f = r["median"], r["floor"]
    sync = r["mode"] == "sync"
    gen = f"{m['output_tokens'] / m['generate_s']:.0f} output tok/s while generating, " if sync else ""
    wait = m["generate_s"] + m["reward_s"] + m["idle_s"]
    rollout = f"rollout wait {m['rollout_cpu_s'] / wait:.2f}, " if wait > 0.1 else ""
    print(
        f"ptrain {r['mode']}: {m['step_s']:.2f} s/step (median of {r['steps_timed']}; the first, compiling, "
        f"{r['compile_step_s']:.1f} s) = generate {m['generate_s']:.2f} + reward {m['reward_s']:.3f} + idle "
        f"{m['idle_s']:.2f} + batch {m['batch_s']:.2f} + train {m['train_s']:.2f} + weight sync {m['sync_s']:.3f}; "
        f"responses {m['response_length']:.1f} tokens (truncated {m['truncated_frac']:.2f}), prompts "
        f"{r['prompt_tokens_mean']:.1f}, rows of {r['seq_len']}, grad_accum {r['grad_accum']}; {gen}"
        f"{m['train_tokens'] / m['train_s']:.0f} tok/s in the train step, {m['train_tokens'] / m['step_s']:.0f} "
        f"trained tok/s per step; busy cores: {rollout}train step {m['train_cpu_s'] / m['train_s']:.2f}, whole step "
        f"{m['step_cpu_s'] / m['step_s']:.2f}; "
        f"stale groups dropped {m['dropped_stale_groups']:.0f}; peak RSS {r['peak_rss_gib']:.2f} GiB",
        flush=True,
    )
    print(
        f"  floor: {f['gen_gflop'] + f['train_gflop']:.0f} GFLOP (generate {f['gen_gflop']:.0f}, train "
        f"{f['train_gflop']:.0f}) = {f['flop_floor_s']:.2f} s at {r['matmul_gflops']:.0f} GFLOP/s (before / after "
        f"the steps {r['matmul_gflops_before_after'][0]:.0f} / {r['matmul_gflops_before_after'][1]:.0f}); "
        f"{f['gen_gbyte'] + f['train_gbyte']:.1f} GB of weights and KV = {f['byte_floor_s']:.2f} s at "
        f"{r['memory_gbs']:.1f} GB/s; step floor {f['floor_s']:.2f} s (generate {f['gen_floor_s']:.2f} + train "
        f"{f['train_floor_s']:.2f}): the step is {m['step_s'] / f['floor_s']:.2f}x its floor, the train step "
        f"{m['train_s'] / f['train_floor_s']:.2f}x"
        + (f", generation {m['generate_s'] / f['gen_floor_s']:.2f}x" if sync else ""),
        flush=True,
    )


def print_trl(t: dict) -> None:
    parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(t["breakdown_s"].items()))
    lengths = t["completion_length_mean"]
    print(
        f"TRL GRPOTrainer: {t['step_s']:.2f} s/step (median; steps {[round(x, 2) for x in t['step_times']]}); "
        f"{parts}; " + (f"completions {lengths:.1f} tokens; " if lengths is not None else "") + f"peak RSS "
        f"{t['peak_rss_gib']:.2f} GiB; {t['times_floor']:.2f}x the same floor at the rates around its run "
        f"({t['floor_s']:.2f} s; matmul before / after {t['matmul_gflops_before_after'][0]:.0f} / "
        f"{t['matmul_gflops_before_after'][1]:.0f} GFLOP/s)",
        flush=True,
    )


def child(args, mode: str) -> dict:
    """Run one mode in a fresh process (its own compiles and peak RSS); returns its result."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--json", out, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--prompts", str(args.prompts), "--group", str(args.group),
           "--new-tokens", str(args.new_tokens), "--grad-accum", str(args.grad_accum),
           "--decode-steps", str(args.decode_steps), "--quiet"]  # fmt: skip
    if args.small:
        cmd.append("--small")
    if args.tokenizer:
        cmd += ["--tokenizer", args.tokenizer]
    for o in args.override:
        cmd += ["--override", o]
    subprocess.run(cmd, check=True)
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["sync", "async", "both"], default="both",
                    help="both: sync then async, each in its own process")  # fmt: skip
    ap.add_argument("--steps", type=int, default=3, help="timed optimizer steps (median reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps after the first (compiling) one")
    ap.add_argument("--rounds", type=int, default=1, help="repeat the sequence (modes, then TRL) this many times")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8, help="samples per prompt")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--grad-accum", type=int, default=4,
                    help="train.grad_accum: micro-batches of the step (the same gradient; ~1.5k tokens each by default)")  # fmt: skip
    ap.add_argument("--decode-steps", type=int, default=8, help="rollout.decode_steps")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the peers' with --with-trl, "
                    "else the embedded one)")  # fmt: skip
    ap.add_argument("--small", action="store_true", help="a 2-layer d128 model (smoke)")
    ap.add_argument("--override", action="append", default=[], help="a further Hydra override (repeatable)")
    ap.add_argument("--with-trl", metavar="PEERS_DIR", default=None,
                    help="then run TRL's bench_trl_grpo.py in PEERS_DIR (venv/, models/, results/)")  # fmt: skip
    ap.add_argument("--trl-scripts", default=PEER_SCRIPTS, help="folder of the peers' scripts")
    ap.add_argument("--trl-steps", type=int, default=4, help="TRL's steps (its script drops the first)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rates-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rates_only:  # for the driver, around TRL's run: a process of its own, as the modes have
        print(json.dumps(machine_rates(args.small)))
        return
    if args.with_trl and not args.tokenizer:
        args.tokenizer = os.path.join(args.with_trl, "models", "tokenizer")
        if not os.path.isfile(os.path.join(args.tokenizer, "tokenizer.json")):
            py = os.path.join(args.with_trl, "venv", "bin", "python")
            subprocess.run([py, os.path.join(args.trl_scripts, "make_models.py")], check=True, cwd=args.with_trl,
                           env=dict(os.environ, PEERS_DIR=args.with_trl, PYTHONPATH=args.trl_scripts))  # fmt: skip

    cpu = subprocess.run(["sh", "-c", "lscpu | grep 'Model name' | head -1"], capture_output=True, text=True).stdout
    modes = ["sync", "async"] if args.mode == "both" else [args.mode]
    in_process = len(modes) == 1 and args.rounds == 1 and not args.with_trl
    if in_process:
        tune_xla_cpu(compute_dtype="float32")  # as the CLI does for a dense float32 model
        result = run_mode(args, modes[0])
        result.update(cpu=cpu.strip(), load_average=load_average())
        if not args.quiet:
            print_mode(result)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return

    print(f"{cpu.strip()}; load average {load_average()}", flush=True)
    results: list[dict] = []
    for r in range(args.rounds):
        for mode in modes:
            res = child(args, mode)
            res.update(round=r, load_average_after=load_average())
            print_mode(res)
            print(f"  (load average after: {res['load_average_after']})", flush=True)
            results.append(res)
        if args.with_trl:
            before = rates_in_subprocess(args)
            t = trl_summary(run_trl(args.with_trl, args.trl_scripts, args.trl_steps, args.new_tokens))
            after = rates_in_subprocess(args)
            gflops, gbs = max(before[0], after[0]), max(before[1], after[1])
            # TRL's step does the same work (generation, then one forward and backward over the
            # same tokens: beta 0, one iteration), so the floor of ours at the rates around its run.
            floor = floor_at(results[-1]["floor"], gflops, gbs)
            t.update(round=r, load_average_after=load_average(), matmul_gflops_before_after=[before[0], after[0]],
                     floor_s=floor, times_floor=t["step_s"] / floor)  # fmt: skip
            print_trl(t)
            print(f"  (load average after: {t['load_average_after']})", flush=True)
            results.append(t)
    trl = [x for x in results if x["side"] == "trl"]
    for mode in modes:
        mine = [x for x in results if x.get("mode") == mode]
        ours = [x["median"]["step_s"] for x in mine]
        line = f"ptrain {mode}: {statistics.median(ours):.2f} s/step over {len(ours)} round(s) {[round(x, 2) for x in ours]}"
        if trl:
            by_round = [t["step_s"] / o for t, o in zip(trl, ours)]
            # The same ratio with each side's step divided by the floor at the rates measured
            # around it: how far each is from the machine's limit as it was during its run.
            by_floor = [t["times_floor"] / (o["median"]["step_s"] / o["floor"]["floor_s"]) for t, o in zip(trl, mine)]
            line += (f"; TRL {statistics.median(x['step_s'] for x in trl):.2f} s/step "
                     f"{[round(x['step_s'], 2) for x in trl]}; TRL / ptrain per round {[round(x, 2) for x in by_round]}, "
                     f"median {statistics.median(by_round):.2f}x; as multiples of the floor during each run "
                     f"{[round(x, 2) for x in by_floor]}, median {statistics.median(by_floor):.2f}x")  # fmt: skip
        print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu.strip(), "results": results}, f, indent=1)


if __name__ == "__main__":
    reexec_with_malloc_tuning()  # the CLI's malloc setting (PTRAIN_MALLOC_TUNING=0 turns it off)
    main()
