"""The training service behind `python -m ptrain.tinker`: models, futures' work, checkpoints.

Transport-free: `ptrain/tinker/server.py` decodes Tinker's wire format and calls these
methods; each returns plain Python values (or ptrain.client types) and raises `TinkerError`
(or ValueError, a user error) on bad input.

One base model is loaded once. Each `create_model` makes a `ptrain.TrainingClient` holding a
LoRA adapter (and its optimizer state) over that shared base; `save_weights_for_sampler`
snapshots an adapter under a `tinker://<model_id>/sampler_weights/<name>` path, and one
rollout engine over the base serves every snapshot as a named adapter (`max_loras` slots,
least recently used one evicted). `save_state` writes adapters and optimizer state with
Orbax under `<root_dir>/<model_id>/weights/<name>`, and `load_state` reads them back.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

SCHEME = "tinker://"
LORA_ALPHA = 32.0
"""Tinker's adapters scale their update by alpha / rank with alpha fixed at 32 (the
cookbook's learning-rate helpers assume it)."""
LORA_FIELDS = ("rank", "seed", "train_unembed", "train_mlp", "train_attn")
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


class TinkerError(Exception):
    """A request the service refuses: `status` (HTTP), `category` (Tinker's: user | server)."""

    def __init__(self, message: str, status: int = 400, category: str = "user"):
        super().__init__(message)
        self.status, self.category = status, category


@dataclass
class Model:
    """One training client: its adapter, optimizer state and where its checkpoints go."""

    model_id: str
    session_id: str
    lora_config: dict
    client: Any
    dir: str
    created: float = field(default_factory=time.time)
    lock: threading.Lock = field(default_factory=threading.Lock)
    """One operation at a time on a model (forward_backward, optim_step, saves, loads)."""


@dataclass
class Snapshot:
    """Adapter weights saved for sampling, addressed by their tinker:// path."""

    path: str
    model_id: str
    adapters: Any
    spec: Any
    servable: bool
    """Whether the engine applies it as a per-request adapter (else it samples merged weights)."""


class TinkerService:
    """See the module docstring.

    model_path: a local Hugging Face folder (with its tokenizer); base_model: the name clients
    ask for (create_model's base_model must equal it); root_dir: where checkpoints go;
    max_loras: adapters the shared engine serves at once; max_lora_rank: the largest rank a
    model may ask for; context_length: the engine's (default: the model's max_seq_len);
    max_merged_engines: engines kept for snapshots that adapt the output head or the routed
    experts, which the shared engine cannot serve per request (each holds merged weights).
    """

    def __init__(self, model_path: str, *, base_model: str, root_dir: str, max_loras: int = 8,
                 max_lora_rank: int = 64, context_length: int | None = None, seed: int = 0,
                 max_running_requests: int = 32, max_merged_engines: int = 2):  # fmt: skip
        from ptrain.client import load_base

        if max_loras < 1 or max_lora_rank < 1 or max_merged_engines < 1:
            raise ValueError("max_loras, max_lora_rank and max_merged_engines must be >= 1")
        self.base = load_base(model_path)
        if self.base.tokenizer is None:
            raise ValueError(f"'{model_path}' holds no tokenizer.json; the server needs the model's tokenizer")
        self.model_path, self.base_model = os.path.abspath(model_path), base_model
        self.root_dir = os.path.abspath(root_dir)
        os.makedirs(self.root_dir, exist_ok=True)
        self.max_loras, self.max_lora_rank, self.context_length = max_loras, max_lora_rank, context_length
        self.seed, self.max_running_requests, self.max_merged_engines = seed, max_running_requests, max_merged_engines
        self.sessions: dict[str, dict] = {}
        self.models: dict[str, Model] = {}
        self.snapshots: dict[str, Snapshot] = {}
        self.samplers: dict[str, dict] = {}
        self._lock = threading.Lock()  # the tables above
        self._engines = threading.Condition()  # engine choice, adapter slots, merged weights
        self._shared = None
        self._slot_use: OrderedDict[str, int] = OrderedDict()  # adapter name -> requests running, LRU order
        self._merged: OrderedDict[int, dict] = OrderedDict()  # engine id -> {"engine", "path", "busy"}
        from ptrain.serve.server import Detokenizer

        self.detok = Detokenizer(self.base.tokenizer)

    # ---------------------------------------------------------------------- sessions, models

    def capabilities(self) -> dict:
        return {"supported_models": [{"model_name": self.base_model}]}

    def create_session(self, tags=None, user_metadata=None) -> str:
        session_id = f"session-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self.sessions[session_id] = {"tags": list(tags or []), "user_metadata": dict(user_metadata or {})}
        return session_id

    def create_model(self, session_id: str, base_model: str, lora_config: dict | None,
                     user_metadata: dict | None = None) -> str:  # fmt: skip
        """A new LoRA training model; lora_config is Tinker's LoraConfig as a dict (rank,
        seed, train_unembed, train_mlp, train_attn). Returns the model_id."""
        from ptrain.client import TrainingClient

        self._check_session(session_id)
        self._check_base(base_model)
        lora = self._lora_of(lora_config)
        model_id = f"model-{uuid.uuid4().hex[:12]}"
        folder = os.path.join(self.root_dir, model_id)
        client = TrainingClient(self.base, lora=lora, seed=int(lora_config.get("seed") or self.seed))
        os.makedirs(folder, exist_ok=True)
        meta = {"base_model": self.base_model, "lora_config": _lora_dict(lora_config), "user_metadata": user_metadata}
        with open(os.path.join(folder, "model.json"), "w") as f:
            json.dump(meta, f, indent=1)
        with self._lock:
            self.models[model_id] = Model(model_id, session_id, meta["lora_config"], client, folder)
        return model_id

    def get_info(self, model_id: str) -> dict:
        model = self._model(model_id)
        return {
            "model_id": model_id,
            "model_data": {
                "arch": self.base.cfg.family,
                "model_name": self.base_model,
                "tokenizer_id": self.model_path,
            },
            "is_lora": True,
            "lora_rank": model.lora_config["rank"],
            "model_name": self.base_model,
        }

    def unload_model(self, model_id: str) -> None:
        with self._lock:
            model = self.models.pop(model_id, None)
        if model is None:
            raise TinkerError(f"unknown model_id '{model_id}'", status=404)
        model.client.close()

    # ------------------------------------------------------------------------------ training

    def forward_backward(self, model_id: str, data, loss_fn: str, loss_fn_config: dict | None,
                         forward_only: bool):  # fmt: skip
        """data: a list of ptrain.client.Datum. Returns ptrain.client.ForwardOutput."""
        model = self._model(model_id)
        with model.lock:
            run = model.client.forward if forward_only else model.client.forward_backward
            return run(list(data), loss_fn, loss_fn_config or None)

    def optim_step(self, model_id: str, adam_params: dict):
        from ptrain.client import AdamParams

        model = self._model(model_id)
        known = {f for f in AdamParams.__dataclass_fields__}
        params = {k: v for k, v in dict(adam_params or {}).items() if k in known and v is not None}
        with model.lock:
            try:
                return model.client.optim_step(params)
            except RuntimeError as e:  # no gradient accumulated
                raise TinkerError(str(e)) from None

    # --------------------------------------------------------------------------- checkpoints

    def save_state(self, model_id: str, name: str | None) -> str:
        """Adapters + optimizer state; returns 'tinker://<model_id>/weights/<name>'."""
        model = self._model(model_id)
        with model.lock:
            name = self._name(name, model)
            folder = os.path.join(model.dir, "weights", name)
            shutil.rmtree(folder, ignore_errors=True)  # a name saved again is replaced
            try:
                model.client.save_state(folder)
            except RuntimeError as e:  # gradients no optim_step applied
                raise TinkerError(str(e)) from None
        return f"{SCHEME}{model_id}/weights/{name}"

    def load_state(self, model_id: str, path: str, optimizer: bool) -> None:
        """Restore a save_state path (any model's with the same LoRA shape) into model_id."""
        model = self._model(model_id)
        folder = self._folder(path, "weights")
        with model.lock:
            try:
                model.client.load_state(folder)
            except ValueError as e:
                raise TinkerError(f"{path}: {e}") from None
            if not optimizer:
                model.client.reset_optimizer()

    def create_model_from_state(self, session_id: str, path: str, optimizer: bool) -> str:
        """A new model whose LoRA config and weights (and optimizer state) come from a save_state path."""
        folder = self._folder(path, "weights")
        with open(os.path.join(os.path.dirname(os.path.dirname(folder)), "model.json")) as f:
            meta = json.load(f)
        model_id = self.create_model(session_id, self.base_model, meta["lora_config"], meta.get("user_metadata"))
        self.load_state(model_id, path, optimizer)
        return model_id

    def save_for_sampler(self, model_id: str, name: str | None) -> str:
        """Snapshot the adapter; returns 'tinker://<model_id>/sampler_weights/<name>'."""
        import jax
        import jax.numpy as jnp
        import orbax.checkpoint as ocp

        from ptrain.models.lora import SERVABLE

        model = self._model(model_id)
        with model.lock:
            name = self._name(name, model)
            client = model.client
            adapters = jax.tree.map(jnp.copy, client.params)
            folder = os.path.join(model.dir, "sampler_weights", name)
            shutil.rmtree(folder, ignore_errors=True)
            with ocp.StandardCheckpointer() as ckpt:
                ckpt.save(folder, adapters)
        path = f"{SCHEME}{model_id}/sampler_weights/{name}"
        servable = set(client.lora.targets) <= set(SERVABLE) and client.lora.rank <= self.max_lora_rank
        with self._lock:
            self.snapshots[path] = Snapshot(path, model_id, adapters, client.lora, servable)
        return path

    def checkpoints(self, model_id: str) -> list[dict]:
        """[{"checkpoint_id", "checkpoint_type": "training" | "sampler", "tinker_path", "time", "size_bytes"}]"""
        model = self._model(model_id)
        out = []
        for kind, sub in (("training", "weights"), ("sampler", "sampler_weights")):
            root = os.path.join(model.dir, sub)
            for name in sorted(os.listdir(root)) if os.path.isdir(root) else ():
                folder = os.path.join(root, name)
                size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)
                out.append({
                    "checkpoint_id": f"{sub}/{name}",
                    "checkpoint_type": kind,
                    "tinker_path": f"{SCHEME}{model_id}/{sub}/{name}",
                    "time": os.path.getmtime(folder),
                    "size_bytes": size,
                })  # fmt: skip
        return out

    # ------------------------------------------------------------------------------ sampling

    def create_sampling_session(self, session_id: str, model_path: str | None, base_model: str | None) -> str:
        """A sampler pinned to a sampler_weights path (or to the base model). Returns its id."""
        self._check_session(session_id)
        if model_path:
            self._snapshot(model_path)
        elif base_model:
            self._check_base(base_model)
        else:
            raise TinkerError("create a sampling session with a model_path (tinker://...) or a base_model")
        sampler_id = f"sampler-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self.samplers[sampler_id] = {
                "sampler_id": sampler_id,
                "base_model": self.base_model,
                "model_path": model_path or None,
                "session_id": session_id,
            }
        return sampler_id

    def sampler_info(self, sampler_id: str) -> dict:
        with self._lock:
            info = self.samplers.get(sampler_id)
        if info is None:
            raise TinkerError(f"unknown sampling session '{sampler_id}'", status=404)
        return {k: info[k] for k in ("sampler_id", "base_model", "model_path")}

    def sample(self, *, prompt: list[int], num_samples: int, sampling_params: dict,
               sampling_session_id: str | None = None, model_path: str | None = None,
               base_model: str | None = None, prompt_logprobs: bool = False,
               topk_prompt_logprobs: int = 0) -> dict:  # fmt: skip
        """Tinker's SamplingParams dict (max_tokens, seed, stop (str | [str] | [int]),
        temperature, top_k, top_p). Returns {"sequences": [{"tokens", "logprobs",
        "stop_reason": "stop" | "length"}], "prompt_logprobs": [float | None] | None,
        "topk_prompt_logprobs": [[(id, logprob)] | None] | None}."""
        from ptrain.rollout.protocol import GenerateRequest, RequestError, SamplingParams

        if sampling_session_id:
            info = self.sampler_info(sampling_session_id)
            model_path = info["model_path"]
        elif not model_path:
            self._check_base(base_model or self.base_model)
        self._check_prompt(prompt)
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise TinkerError(f"num_samples must be an integer >= 1, got {num_samples!r}")
        sp, stops = self._sampling(dict(sampling_params or {}))
        sp = SamplingParams(**sp, n=num_samples)
        k = int(topk_prompt_logprobs or 0)
        want_prompt = bool(prompt_logprobs) or k > 0
        snapshot = self._snapshot(model_path) if model_path else None
        engine, lora_name, release = self._acquire(snapshot)
        try:
            request = GenerateRequest(
                rid=f"tinker-{uuid.uuid4().hex[:16]}",
                input_ids=tuple(int(t) for t in prompt),
                sampling=sp,
                lora_path=lora_name,
                return_prompt_logprobs_from=0 if want_prompt else None,
                top_logprobs_num=k,
            )
            try:
                samples = self._generate(engine, request, stops)
            except RequestError as e:
                raise TinkerError(str(e)) from None
        finally:
            release()
        return self._response(samples, stops, want_prompt, prompt_logprobs, k)

    def close(self) -> None:
        with self._lock:
            models, self.models = list(self.models.values()), {}
        for model in models:
            model.client.close()
        with self._engines:
            engines = [self._shared] + [m["engine"] for m in self._merged.values()]
            self._shared, self._merged = None, OrderedDict()
        for engine in engines:
            if engine is not None:
                engine.close()

    # ----------------------------------------------------------------------------- internals

    def _model(self, model_id: str) -> Model:
        with self._lock:
            model = self.models.get(model_id)
        if model is None:
            raise TinkerError(f"unknown model_id '{model_id}'; create_model returns the ids this server knows", 404)
        return model

    def finish_session(self, session_id: str, reason: str, detail: str | None = None) -> None:
        """The SDK's ServiceClient.close: the session ends with `reason` (the first one given
        stays); later calls naming it are refused."""
        self._check_known(session_id)
        with self._lock:
            self.sessions[session_id].setdefault("finished", {"reason": reason, "detail": detail})

    def _check_known(self, session_id: str) -> None:
        with self._lock:
            known = session_id in self.sessions
        if not known:
            raise TinkerError(f"unknown session_id '{session_id}'; create_session first (the SDK's ServiceClient does)")

    def _check_session(self, session_id: str) -> None:
        self._check_known(session_id)
        with self._lock:
            finished = self.sessions[session_id].get("finished")
        if finished is not None:
            raise TinkerError(
                f"session '{session_id}' was finished ({finished['reason']}); a new ServiceClient starts a new session"
            )

    def _check_base(self, base_model: str | None) -> None:
        if base_model != self.base_model:
            raise TinkerError(
                f"base_model '{base_model}' is not served here; this server trains '{self.base_model}' "
                "(python -m ptrain.tinker --base-model names it)"
            )

    def _lora_of(self, cfg: dict | None):
        from ptrain.config.lora import LoRAConfig

        if not isinstance(cfg, dict) or "rank" not in cfg:
            raise TinkerError("create_model needs a lora_config with a rank; this server trains LoRA adapters only")
        unknown = sorted(set(cfg) - set(LORA_FIELDS))
        if unknown:
            raise TinkerError(f"lora_config {unknown} are unknown; it takes {list(LORA_FIELDS)}")
        rank = cfg["rank"]
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= self.max_lora_rank:
            raise TinkerError(
                f"lora_config.rank must be an integer in [1, {self.max_lora_rank}], got {rank!r} "
                "(python -m ptrain.tinker --max-lora-rank raises the limit)"
            )
        targets = []
        if cfg.get("train_attn", True):
            targets.append("attention")
        if cfg.get("train_mlp", True):
            targets += ["mlp"] + (["experts"] if self.base.cfg.n_experts > 0 else [])
        if cfg.get("train_unembed", True) and "lm_head" in self.base.params:
            targets.append("lm_head")  # a head tied to the embedding has no weight of its own to adapt
        if not targets:
            raise TinkerError("lora_config trains nothing: set one of train_attn, train_mlp, train_unembed")
        return LoRAConfig(rank=rank, alpha=LORA_ALPHA, targets=targets)

    def _name(self, name: str | None, model: Model) -> str:
        if name is None or name == "":
            return f"step{model.client.step:06d}-{uuid.uuid4().hex[:6]}"
        if not isinstance(name, str) or not NAME.match(name):
            raise TinkerError(f"checkpoint name {name!r}: use 1-128 letters, digits, '_', '-' or '.'")
        return name

    def _folder(self, path: str, kind: str) -> str:
        """The local folder of a tinker:// path of this server."""
        model_id, sub, name = _parse(path)
        if sub != kind:
            raise TinkerError(f"'{path}' is a {sub} path; pass a tinker://<model_id>/{kind}/<name> path")
        folder = os.path.join(self.root_dir, model_id, sub, name)
        if not os.path.isdir(folder):
            raise TinkerError(f"no checkpoint at '{path}'; list them with the rest client", status=404)
        return folder

    def _snapshot(self, path: str) -> Snapshot:
        """A sampler_weights path, loaded from disk when not in memory (a restarted server)."""
        with self._lock:
            snap = self.snapshots.get(path)
        if snap is not None:
            return snap
        import orbax.checkpoint as ocp

        from ptrain.client import TrainingClient
        from ptrain.models.lora import SERVABLE

        folder = self._folder(path, "sampler_weights")
        model_id = _parse(path)[0]
        with open(os.path.join(self.root_dir, model_id, "model.json")) as f:
            lora = self._lora_of(json.load(f)["lora_config"])
        like = TrainingClient(self.base, lora=lora)  # the adapters' shapes and shardings
        import jax

        target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), like.params,
                              like._param_sh)  # fmt: skip
        with ocp.StandardCheckpointer() as ckpt:
            adapters = ckpt.restore(folder, target)
        snap = Snapshot(path, model_id, adapters, like.lora, set(like.lora.targets) <= set(SERVABLE))
        with self._lock:
            self.snapshots[path] = snap
        return snap

    def _acquire(self, snap: Snapshot | None):
        """(engine, adapter name or None, release): an engine serving `snap` (None: the base)
        until release() is called."""
        if snap is None or snap.servable:
            return self._acquire_shared(snap)
        return self._acquire_merged(snap)

    def _acquire_shared(self, snap: Snapshot | None):
        from ptrain.models.lora import SERVABLE
        from ptrain.rollout.local import LocalEngine

        with self._engines:
            if self._shared is None:
                self._shared = LocalEngine(
                    self.base.model_def.bind(self.base.params, self.base.model_state),
                    max_running_requests=self.max_running_requests,
                    context_length=self.context_length,
                    mesh=self.base.mesh,
                    eos_token_ids=self._eos(),
                    seed=self.seed,
                    max_loras=self.max_loras,
                    max_lora_rank=self.max_lora_rank,
                    lora_targets=SERVABLE,
                )
            engine = self._shared
            if snap is None:
                return engine, None, lambda: None
            name = snap.path
            while name not in self._slot_use and len(self._slot_use) >= self.max_loras:
                idle = [n for n, busy in self._slot_use.items() if busy == 0]
                if idle:
                    engine.unload_lora(idle[0])  # the least recently used adapter no request holds
                    del self._slot_use[idle[0]]
                else:
                    self._engines.wait()
            if name not in self._slot_use:
                engine.update_lora(name, snap.adapters, snap.spec)
                self._slot_use[name] = 0
            self._slot_use[name] += 1
            self._slot_use.move_to_end(name)

        def release() -> None:
            with self._engines:
                self._slot_use[name] -= 1
                self._engines.notify_all()

        return engine, name, release

    def _acquire_merged(self, snap: Snapshot):
        import jax

        from ptrain.models.lora import merge
        from ptrain.rollout.local import LocalEngine

        with self._engines:
            while True:
                same = [k for k, m in self._merged.items() if m["path"] == snap.path]
                if same:
                    key = same[0]
                    break
                idle = [k for k, m in self._merged.items() if m["busy"] == 0]
                if len(self._merged) < self.max_merged_engines or idle:
                    weights = jax.jit(merge, static_argnums=2)(self.base.params, snap.adapters, snap.spec)
                    if len(self._merged) < self.max_merged_engines:
                        key = max(self._merged, default=-1) + 1
                        engine = LocalEngine(
                            self.base.model_def.bind(weights, self.base.model_state),
                            max_running_requests=self.max_running_requests,
                            context_length=self.context_length,
                            mesh=self.base.mesh,
                            eos_token_ids=self._eos(),
                            seed=self.seed,
                        )
                        self._merged[key] = {"engine": engine, "path": snap.path, "busy": 0}
                    else:  # reuse the least recently used idle engine: a weight swap, no recompile
                        key = idle[0]
                        self._merged[key]["engine"].update_weights(weights, weight_version=snap.path)
                        self._merged[key]["path"] = snap.path
                    break
                self._engines.wait()
            entry = self._merged[key]
            entry["busy"] += 1
            self._merged.move_to_end(key)

        def release() -> None:
            with self._engines:
                entry["busy"] -= 1
                self._engines.notify_all()

        return entry["engine"], None, release

    def _generate(self, engine, request, stops: tuple[str, ...]) -> list:
        """The request's samples. With stop strings, a sample whose new text completes one is
        aborted as soon as the waiting thread sees it (the cut after the stop comes later)."""
        if not stops:
            return engine.generate_many([request])[0]
        longest = max(len(x) for x in stops)
        latest: dict[int, Any] = {}
        ended: set[int] = set()

        def on_update(samples) -> None:  # the engine's thread: only note what is new
            for x in samples:
                latest[x.index] = x

        future = engine.submit(request, on_update=on_update)
        while True:
            try:
                return future.result(timeout=0.02)
            except TimeoutError:
                pass
            for index, x in list(latest.items()):
                if index in ended or x.finish_reason is not None:
                    continue
                tail = self.detok.text(x.output_ids[-(longest + 8) :], skip_special_tokens=False)
                if any(stop in tail for stop in stops):
                    ended.add(index)
                    engine.abort(request.rid if request.sampling.n == 1 else f"{request.rid}-{index}")

    def _eos(self) -> tuple[int, ...]:
        from ptrain.data.tokenizer import stop_token_ids

        return tuple(stop_token_ids(self.base.tokenizer))

    def _check_prompt(self, prompt) -> None:
        if not isinstance(prompt, Sequence) or isinstance(prompt, str) or not prompt:
            raise TinkerError("the prompt holds no tokens; pass a ModelInput with at least one token")
        vocab = self.base.cfg.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
            raise TinkerError(f"the prompt holds token ids outside the vocabulary [0, {vocab})")

    def _sampling(self, p: dict) -> tuple[dict, tuple[str, ...]]:
        """Tinker's SamplingParams -> (ptrain SamplingParams keywords, stop strings)."""
        from ptrain.rollout.protocol import TOP_K_OFF

        max_tokens = p.get("max_tokens")
        if max_tokens is None:
            raise TinkerError("sampling_params.max_tokens is required")
        stop = p.get("stop")
        stop = [] if stop is None else [stop] if isinstance(stop, str | int) else list(stop)
        strings = tuple(s for s in stop if isinstance(s, str))
        ids = tuple(s for s in stop if isinstance(s, int) and not isinstance(s, bool))
        if len(strings) + len(ids) != len(stop) or (strings and ids):
            raise TinkerError(f"sampling_params.stop: strings or token ids (not both), got {p.get('stop')!r}")
        if any(not s for s in strings):
            raise TinkerError("sampling_params.stop holds an empty string")
        top_k = p.get("top_k")
        out = {
            "max_new_tokens": int(max_tokens),
            "temperature": float(p.get("temperature", 1.0) if p.get("temperature") is not None else 1.0),
            "top_p": float(p.get("top_p") if p.get("top_p") is not None else 1.0),
            "top_k": TOP_K_OFF if top_k is None or top_k <= 0 else int(top_k),
            "stop_token_ids": ids,
            "sampling_seed": None if p.get("seed") is None else int(p["seed"]),
        }
        checks = ((out["max_new_tokens"] >= 0, "max_tokens must be >= 0"),
                  (out["temperature"] >= 0, "temperature must be >= 0"),
                  (0 < out["top_p"] <= 1, "top_p must be in (0, 1]"))  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise TinkerError(f"sampling_params: {message}, got {p}")
        return out, strings

    def _response(self, samples, stops, want_prompt: bool, prompt_logprobs: bool, k: int) -> dict:
        from ptrain.serve.server import cut_at_stop

        sequences = []
        for s in samples:
            if stops:
                cut = cut_at_stop(s, stops, self.detok)
                if cut is not None:
                    s = cut[0]
            if s.finish_reason is None or s.finish_reason.type == "abort":
                raise TinkerError(f"sampling was aborted: {getattr(s.finish_reason, 'message', '')}", 503, "server")
            sequences.append({
                "tokens": [int(t) for t in s.output_ids],
                "logprobs": [float(x) for x in s.logprobs],
                "stop_reason": "stop" if s.finish_reason.type == "stop" else "length",
            })  # fmt: skip
        first = samples[0]
        out: dict[str, Any] = {"sequences": sequences, "prompt_logprobs": None, "topk_prompt_logprobs": None}
        if want_prompt and prompt_logprobs:
            out["prompt_logprobs"] = [None] + [float(x) for x in first.prompt_logprobs or ()]
        if want_prompt and k:
            top = first.prompt_top_logprobs or ()
            out["topk_prompt_logprobs"] = [None] + [[(int(t), float(lp)) for t, lp in row] for row in top]
        return out


def _parse(path: str) -> tuple[str, str, str]:
    """'tinker://<model_id>/<weights | sampler_weights>/<name>' -> its three parts."""
    if not isinstance(path, str) or not path.startswith(SCHEME):
        raise TinkerError(
            f"'{path}' is not a tinker:// path; pass what save_state or save_weights_for_sampler returned"
        )
    parts = path[len(SCHEME) :].split("/")
    if len(parts) != 3 or parts[1] not in ("weights", "sampler_weights") or not all(NAME.match(p) for p in parts):
        raise TinkerError(f"'{path}': expected tinker://<model_id>/weights/<name> or .../sampler_weights/<name>")
    return parts[0], parts[1], parts[2]


def _lora_dict(cfg: dict) -> dict:
    """The LoRA config as saved: Tinker's defaults filled in."""
    out = {"rank": int(cfg["rank"]), "seed": cfg.get("seed"), "train_unembed": True, "train_mlp": True,
           "train_attn": True}  # fmt: skip
    out.update({k: bool(cfg[k]) for k in ("train_unembed", "train_mlp", "train_attn") if k in cfg})
    return out
