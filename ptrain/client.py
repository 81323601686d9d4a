"""`ptrain.TrainingClient`: training primitives in process, in Tinker's shape.

For people who write their own loop (the tinker-cookbook style) over the same pure, jitted
pieces the stages use: the decoder's forward, `ptrain.losses`, optax, the rollout engine.

    client = ptrain.TrainingClient("runs/sft_arithmetic/stages/sft/export")
    out = client.forward_backward([ptrain.Datum(tokens, {"target_tokens": t, "weights": w})],
                                  "cross_entropy")           # gradients accumulate ...
    client.optim_step(ptrain.AdamParams(learning_rate=1e-4))   # ... until one Adam step
    samples = client.sample([prompt_ids], n=4, sampling_params={"max_new_tokens": 32})
    client.save_state("ckpt/step10"); client.save_weights("export/")   # Orbax; an HF folder

A `Datum` is one sequence: `tokens` (the model input, N ids) and `loss_fn_inputs`, per-token
arrays of length N aligned so that position t predicts `target_tokens[t]` (for a full
sequence s: tokens = s[:-1], target_tokens = s[1:]). The named losses and their formulas
are in `ptrain.losses.named`; each is a sum over tokens, as Tinker's are. A Python callable
`loss_fn(data, logprobs) -> loss` or `-> (loss, metrics)` over the per-datum log-prob arrays
(JAX arrays, so the callable must be written in jax.numpy) works too, at the cost of a
second forward pass for its gradient.

Datums are padded to power-of-two shapes (rows to a multiple of the data-parallel size),
so a loop with varying lengths compiles a few programs, not one per call. The optimizer is
optax's AdamW with its hyperparameters in the optimizer state, so each `optim_step` may
pass new ones without a recompile; weight decay applies where `ptrain.train.optim.decay_mask`
says (matrices; norms, biases and embeddings as `optim` says). The MoE router-bias update of
the stages is not applied here.

With `lora=LoRAConfig(rank=...)` the client trains LoRA adapters over frozen base weights:
gradients, optimizer state and `save_state` hold the adapters alone, `sample` serves them as
an adapter of the engine, and `save_weights` writes the merged model. Several clients can
share one copy of the base: `base = ptrain.client.load_base(path)`, then
`TrainingClient(base, lora=...)` for each (what `python -m ptrain.tinker` does per model).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ptrain.config.lora import LoRAConfig
from ptrain.config.mesh import MeshConfig
from ptrain.config.model import ModelConfig
from ptrain.config.optim import OptimConfig
from ptrain.losses.named import NAMED_LOSSES, OPTIONAL_INPUTS, REQUIRED_INPUTS, loss_config, named_loss

INT_INPUTS = ("target_tokens",)
CLIENT_ADAPTER = "client"
"""The adapter name a LoRA client's weights take in its sampling engine."""


@dataclass(frozen=True)
class Datum:
    """One training sequence: the model input and the per-token inputs of the loss."""

    tokens: Sequence[int]
    """Model input token ids (N >= 1)."""
    loss_fn_inputs: Mapping[str, Any] = field(default_factory=dict)
    """Per-token arrays of length N: target_tokens (int), weights, logprobs (the sampler's),
    advantages (float); which ones a loss needs is `ptrain.losses.named.REQUIRED_INPUTS`."""


@dataclass(frozen=True)
class AdamParams:
    """One optimizer step's hyperparameters (Tinker's AdamParams, same names and defaults)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW), applied where `decay_mask` says."""
    grad_clip_norm: float = 0.0
    """Clip the accumulated gradient to this global norm first; 0 does not clip."""


@dataclass
class ForwardOutput:
    """What forward and forward_backward return."""

    logprobs: list[np.ndarray]
    """Per datum, float32 [N]: log p(target_tokens[t] | tokens[:t+1]) under the current weights."""
    loss: float
    """The loss summed over the batch (Tinker's `loss:sum`)."""
    metrics: dict[str, float]


@dataclass
class OptimStepOutput:
    step: int
    """Optimizer steps taken so far."""
    grad_norm: float
    """Global norm of the accumulated gradient, before clipping."""
    metrics: dict[str, float]


@dataclass(frozen=True)
class BaseWeights:
    """A model loaded and placed on its mesh once, whose weights LoRA clients share."""

    model_def: Any
    params: Any
    model_state: Any
    param_shardings: Any
    model_state_shardings: Any
    param_axes: Any
    cfg: ModelConfig
    mesh: Any
    tokenizer: Any = None
    path: str | None = None
    """The Hugging Face folder it came from (None for a fresh model)."""


def load_base(
    model: str | os.PathLike | ModelConfig,
    *,
    mesh: MeshConfig | None = None,
    dtype: str = "float32",
    seed: int = 0,
    tokenizer: Any = None,
) -> BaseWeights:
    """Load a local Hugging Face folder (or build a fresh model from a ModelConfig, whose
    vocab_size must be set) onto a mesh (default: data parallel over every device)."""
    from ptrain.parallel import DEFAULT_RULES, make_mesh, shardings_for
    from ptrain.train.state import logical_axes, split_model

    jmesh = make_mesh(mesh or MeshConfig())
    path = None
    rules = tuple(DEFAULT_RULES)
    if isinstance(model, ModelConfig):
        from flax import nnx

        from ptrain.models import Decoder

        if model.vocab_size <= 0:
            raise ValueError(
                "TrainingClient(ModelConfig): set vocab_size (> 0); the embedded default takes it from a tokenizer"
            )
        module = Decoder(dataclasses.replace(model, dtype=dtype), rngs=nnx.Rngs(seed))
    elif isinstance(model, str | os.PathLike):
        from ptrain.models import load_hf

        path = os.fspath(model)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(
                f"TrainingClient: '{path}' holds no config.json; pass a local Hugging Face model folder "
                "(nothing is downloaded) or a ModelConfig"
            )
        module = load_hf(path, dtype=dtype, mesh=jmesh, rules=rules)
        if tokenizer is None and os.path.isfile(os.path.join(path, "tokenizer.json")):
            from ptrain.data.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(path)
    else:
        raise TypeError(
            f"TrainingClient(model=...): a Hugging Face folder, a ModelConfig or a BaseWeights, got {type(model).__name__}"
        )
    model_def, params, model_state = split_model(module)
    param_axes, state_axes = logical_axes(module)
    param_sh = shardings_for(params, param_axes, jmesh, list(rules))
    mstate_sh = shardings_for(model_state, state_axes, jmesh, list(rules))
    return BaseWeights(
        model_def=model_def,
        params=jax.device_put(params, param_sh),
        model_state=jax.device_put(model_state, mstate_sh),
        param_shardings=param_sh,
        model_state_shardings=mstate_sh,
        param_axes=param_axes,
        cfg=module.cfg,
        mesh=jmesh,
        tokenizer=tokenizer,
        path=path,
    )


class TrainingClient:
    """A model, its optimizer state and accumulated gradients, and primitives over them.

    model: a local Hugging Face folder (its tokenizer, if it has one, gives the stop ids of
      `sample`), or a `ModelConfig` (a fresh model from `seed`; vocab_size must be set).
    optim: which parameter groups AdamW's weight decay touches (OptimConfig.decay_*); the
      step's hyperparameters come with each `optim_step`.
    mesh: a MeshConfig (default: data parallel over every device).
    """

    def __init__(
        self,
        model: str | os.PathLike | ModelConfig | BaseWeights,
        *,
        lora: LoRAConfig | None = None,
        optim: OptimConfig | None = None,
        mesh: MeshConfig | None = None,
        dtype: str = "float32",
        seed: int = 0,
        vocab_chunk: int = 0,
        tokenizer: Any = None,
        max_running_requests: int = 16,
        context_length: int | None = None,
    ):
        from ptrain.parallel import DEFAULT_RULES, replicated, shardings_for
        from ptrain.parallel.sharding import shardings_following_params
        from ptrain.train.optim import decay_mask

        shared = isinstance(model, BaseWeights)
        if shared and mesh is not None:
            raise ValueError("TrainingClient(BaseWeights, mesh=...): the base is placed already; pass no mesh")
        base = model if shared else load_base(model, mesh=mesh, dtype=dtype, seed=seed, tokenizer=tokenizer)
        self.base = base
        self.mesh = base.mesh
        self.model_path = base.path
        self.model_def = base.model_def
        self.cfg = base.cfg
        self.tokenizer = tokenizer if tokenizer is not None else base.tokenizer
        self.vocab_chunk = int(vocab_chunk)
        self._max_running_requests, self._context_length, self._seed = max_running_requests, context_length, seed
        self.optim = optim or OptimConfig()
        self.lora = None
        self._mstate_sh = base.model_state_shardings
        self.model_state = base.model_state
        if lora is not None and lora.enabled:
            from ptrain.models.lora import LoRASpec, adapter_axes, init_adapters

            self.lora = LoRASpec.of(lora)
            try:
                adapters = init_adapters(base.params, self.lora, jax.random.key(seed))
            except ValueError as e:
                raise ValueError(f"TrainingClient(lora=...): {e}; pass targets this model has") from None
            axes = adapter_axes(base.param_axes, adapters, self.lora)
            self._param_sh = shardings_for(adapters, axes, self.mesh, list(DEFAULT_RULES))
            self.params = jax.device_put(adapters, self._param_sh)
        else:
            self._param_sh = base.param_shardings
            # a shared base must outlive this client's steps, which donate their params
            self.params = jax.tree.map(jnp.copy, base.params) if shared else base.params
        opt = self.optim
        self.tx = optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
            learning_rate=0.0, b1=0.9, b2=0.95, eps=1e-12, weight_decay=0.0, mask=lambda p: decay_mask(p, opt)
        )
        abstract = jax.eval_shape(self.tx.init, self.params)
        self._opt_sh = shardings_following_params(abstract, self.params, self._param_sh, self.mesh)
        self.opt_state = jax.jit(self.tx.init, out_shardings=self._opt_sh)(self.params)
        self.step = 0
        self._grads = None
        self._pending = 0  # forward_backward calls since the last optim_step
        self._rep = replicated(self.mesh)
        self._engine = None
        self._engine_step = -1
        self._compiled: dict[Any, Callable] = {}

    # ------------------------------------------------------------------------- primitives

    def forward(
        self, data: Sequence[Datum], loss_fn: str | Callable = "cross_entropy", loss_fn_config=None
    ) -> ForwardOutput:
        """Log-probs of every datum's targets and the loss, without a gradient."""
        return self._run(data, loss_fn, loss_fn_config, backward=False)

    def forward_backward(
        self, data: Sequence[Datum], loss_fn: str | Callable = "cross_entropy", loss_fn_config=None
    ) -> ForwardOutput:
        """As `forward`, and add the loss's gradient to the accumulated gradient."""
        return self._run(data, loss_fn, loss_fn_config, backward=True)

    def optim_step(self, adam_params: AdamParams | Mapping[str, float] | None = None) -> OptimStepOutput:
        """One AdamW step on the gradient accumulated since the last step, then zero it."""
        p = _adam_params(adam_params)
        if self._grads is None:
            raise RuntimeError("optim_step: no gradient accumulated; call forward_backward first")
        hp = {k: jnp.asarray(v, jnp.float32) for k, v in (
            ("learning_rate", p.learning_rate), ("b1", p.beta1), ("b2", p.beta2), ("eps", p.eps),
            ("weight_decay", p.weight_decay), ("clip", p.grad_clip_norm),
        )}  # fmt: skip
        fn = self._compiled.get("apply")
        if fn is None:
            fn = self._compiled["apply"] = jax.jit(
                _make_apply(self.tx),
                out_shardings=(self._param_sh, self._opt_sh, None),
                donate_argnums=(0, 1),
            )
        self.params, self.opt_state, grad_norm = fn(self.params, self.opt_state, self._grads, hp)
        self._grads, self._pending = None, 0
        self.step += 1
        norm = float(grad_norm)
        return OptimStepOutput(self.step, norm, {"grad_norm": norm, "learning_rate": p.learning_rate})

    def sample(self, prompts: Sequence[Sequence[int]], n: int = 1, sampling_params: Any = None) -> list[list[Any]]:
        """`n` samples of each prompt (token ids) from the current weights, through the
        rollout engine: per prompt a list of `ptrain.rollout.protocol.Sample` (output_ids,
        logprobs under the tempered softmax, finish_reason). sampling_params: a
        SamplingParams or a dict of SGLang's names (max_new_tokens, temperature, top_p, ...)."""
        from ptrain.rollout.protocol import GenerateRequest, SamplingParams

        if isinstance(sampling_params, SamplingParams):
            sp = sampling_params
        else:
            sp = SamplingParams.from_dict(sampling_params)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"sample: n must be an integer >= 1, got {n!r}")
        sp = dataclasses.replace(sp, n=n)
        if isinstance(prompts, str) or not isinstance(prompts, Sequence):
            raise ValueError("sample: pass a list of prompts, each a list of token ids")
        for i, p in enumerate(prompts):
            self._check_ids(p, f"prompt {i}")
        prompts = [[int(t) for t in p] for p in prompts]
        engine = self._synced_engine()
        requests = [GenerateRequest(input_ids=tuple(p), sampling=sp) for p in prompts]
        return engine.generate_many(requests)

    def save_state(self, path: str | os.PathLike) -> str:
        """Write params, optimizer state (with its step count) and step with Orbax."""
        import orbax.checkpoint as ocp

        if self._pending:
            raise RuntimeError(
                f"save_state: {self._pending} forward_backward call(s) hold a gradient no optim_step has applied; "
                "call optim_step first (a checkpoint holds applied steps only)"
            )
        path = os.path.abspath(os.fspath(path))
        if os.path.exists(path):
            raise FileExistsError(f"save_state: '{path}' exists; pass a new folder (nothing was overwritten)")
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(path, self._state())
        return path

    def load_state(self, path: str | os.PathLike) -> None:
        """Continue from a `save_state` folder: params, optimizer state and step."""
        import orbax.checkpoint as ocp

        path = os.path.abspath(os.fspath(path))
        if not os.path.isdir(path):
            raise FileNotFoundError(f"load_state: no checkpoint folder at '{path}'; pass a folder save_state wrote")
        target = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            self._state(),
            {"params": self._param_sh, "opt_state": self._opt_sh, "model_state": self._mstate_sh, "step": self._rep},
        )
        try:
            with ocp.StandardCheckpointer() as ckpt:
                state = ckpt.restore(path, target)
        except Exception as e:  # Orbax raises several kinds for a checkpoint of another model
            raise ValueError(
                f"load_state: '{path}' does not hold this model's state ({type(e).__name__}: {str(e)[:300]}); "
                "pass a folder save_state wrote for the same model"
            ) from None
        self.params, self.opt_state, self.model_state = state["params"], state["opt_state"], state["model_state"]
        self.step = int(state["step"])
        self._grads, self._pending = None, 0

    def reset_optimizer(self) -> None:
        """Fresh optimizer moments (the weights and the step count stay), as after loading
        weights without their optimizer state."""
        self.opt_state = jax.jit(self.tx.init, out_shardings=self._opt_sh)(self.params)
        self._grads, self._pending = None, 0

    def save_weights(self, path: str | os.PathLike) -> str:
        """Write the current weights as a Hugging Face folder (with the tokenizer, when the
        client has one) that transformers, SGLang, `ptrain.serve` and the stages load."""
        from ptrain.models import save_hf

        path = os.path.abspath(os.fspath(path))
        tmp = path + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_hf(self.model_def.bind(self.merged_params(), self.model_state), tmp, tokenizer=self.tokenizer)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        return path

    def close(self) -> None:
        """Stop the sampling engine, if one was started."""
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------------------- internals

    def _frozen(self) -> dict:
        """What the jitted functions read but do not train: the LoRA base (None without LoRA)
        and the model state."""
        return {"base": self.base.params if self.lora is not None else None, "model_state": self.model_state}

    def merged_params(self):
        """Plain weights of the current model: under LoRA the adapters merged into the base."""
        if self.lora is None:
            return self.params
        from ptrain.models.lora import merge

        return jax.jit(merge, static_argnums=2)(self.base.params, self.params, self.lora)

    def _state(self) -> dict:
        return {
            "params": self.params,
            "opt_state": self.opt_state,
            "model_state": self.model_state,
            "step": jax.device_put(jnp.asarray(self.step, jnp.int32), self._rep),
        }

    def _synced_engine(self):
        from ptrain.rollout.local import LocalEngine

        if self._engine is None:
            eos = ()
            if self.tokenizer is not None:
                from ptrain.data.tokenizer import stop_token_ids

                eos = tuple(stop_token_ids(self.tokenizer))
            lora = self._served_lora()
            weights = self.base.params if lora else self.merged_params()
            self._engine = LocalEngine(
                self.model_def.bind(weights, self.model_state),
                max_running_requests=self._max_running_requests,
                context_length=self._context_length,
                mesh=self.mesh,
                eos_token_ids=eos,
                weight_version=str(self.step),
                seed=self._seed,
                **({} if lora is None else dict(max_loras=1, max_lora_rank=lora.rank, lora_targets=lora.targets)),
            )
            if lora is not None:
                self._engine.update_lora(CLIENT_ADAPTER, self.params, lora, weight_version=str(self.step))
                self._engine.set_default_lora(CLIENT_ADAPTER)
            self._engine_step = self.step
        elif self._engine_step != self.step:
            if self._served_lora() is not None:
                self._engine.update_lora(CLIENT_ADAPTER, self.params, self.lora, weight_version=str(self.step))
            else:
                weights = self.merged_params()
                self._engine.update_weights(weights, self.model_state or None, weight_version=str(self.step))
            self._engine_step = self.step
        return self._engine

    def _served_lora(self):
        """The LoRASpec the engine serves as an adapter over the base, or None: without LoRA,
        or with targets an engine cannot apply per request (the output head, routed experts),
        where it samples from the merged weights instead."""
        from ptrain.models.lora import SERVABLE

        if self.lora is None or not set(self.lora.targets) <= set(SERVABLE):
            return None
        return self.lora

    def _check_ids(self, ids: Sequence[int], what: str) -> None:
        if len(ids) == 0:
            raise ValueError(f"{what} is empty; pass at least one token id")
        a = np.asarray(ids)
        if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"{what} must be a flat list of integer token ids, got dtype {a.dtype} shape {a.shape}")
        if a.min() < 0 or a.max() >= self.cfg.vocab_size:
            raise ValueError(f"{what} holds ids outside the model's vocabulary [0, {self.cfg.vocab_size})")

    def _batch(self, data: Sequence[Datum], names: tuple[str, ...]) -> tuple[dict, list[int]]:
        """Datums -> padded [B, L] arrays (the SFT batch contract plus the loss inputs)."""
        _check_data(data)
        lengths = []
        for i, d in enumerate(data):
            self._check_ids(list(d.tokens), f"datum {i}'s tokens")
            lengths.append(len(d.tokens))
        if max(lengths) > self.cfg.max_seq_len:
            i = int(np.argmax(lengths))
            raise ValueError(
                f"datum {i} has {lengths[i]} tokens, more than the model's context of {self.cfg.max_seq_len}; "
                "shorten or split it"
            )
        from ptrain.parallel import batch_devices

        dp = batch_devices(self.mesh)
        rows = _pow2(len(data))
        rows = -(-rows // dp) * dp
        width = max(_pow2(max(lengths)), 8)
        batch = {
            "input_ids": np.zeros((rows, width), np.int32),
            "positions": np.zeros((rows, width), np.int32),
            "segment_ids": np.zeros((rows, width), np.int32),
            "target_ids": np.zeros((rows, width), np.int32),
            "valid": np.zeros((rows, width), np.float32),
        }
        for name in names:
            if name != "target_tokens":
                batch[name] = np.zeros((rows, width), np.float32)
        for i, (d, n) in enumerate(zip(data, lengths)):
            batch["input_ids"][i, :n] = np.asarray(d.tokens, np.int32)
            batch["positions"][i, :n] = np.arange(n)
            batch["segment_ids"][i, :n] = 1
            batch["valid"][i, :n] = 1.0
            for name in names:
                value = np.asarray(d.loss_fn_inputs[name])
                if value.shape != (n,):
                    raise ValueError(
                        f"datum {i}: loss_fn_inputs['{name}'] has shape {value.shape}, expected ({n},) (one value "
                        "per input token)"
                    )
                if name == "target_tokens":
                    self._check_ids(value, f"datum {i}'s target_tokens")
                    batch["target_ids"][i, :n] = value.astype(np.int32)
                else:
                    if not np.all(np.isfinite(value.astype(np.float64))):
                        raise ValueError(f"datum {i}: loss_fn_inputs['{name}'] holds NaN or infinite values")
                    batch[name][i, :n] = value.astype(np.float32)
        return batch, lengths

    def _inputs_of(self, data: Sequence[Datum], loss: str) -> tuple[str, ...]:
        _check_data(data)
        need, may = REQUIRED_INPUTS[loss], OPTIONAL_INPUTS[loss]
        for i, d in enumerate(data):
            given = set(getattr(d, "loss_fn_inputs", {}) or {})
            missing = [k for k in need if k not in given]
            if missing:
                raise ValueError(f"datum {i}: loss_fn '{loss}' needs loss_fn_inputs {list(need)}; missing {missing}")
            extra = sorted(given - set(need) - set(may))
            if extra:
                raise ValueError(
                    f"datum {i}: loss_fn_inputs {extra} are not inputs of '{loss}'; it reads {list(need) + list(may)}"
                )
        optional = [k for k in may if all(k in d.loss_fn_inputs for d in data)]
        partial = [k for k in may if k not in optional and any(k in d.loss_fn_inputs for d in data)]
        if partial:
            raise ValueError(f"loss_fn_inputs {partial} are given for some datums and not others; give them for all")
        return tuple(need) + tuple(optional)

    def _run(self, data, loss_fn, loss_fn_config, *, backward: bool) -> ForwardOutput:
        if callable(loss_fn) and not isinstance(loss_fn, str):
            if loss_fn_config:
                raise ValueError("loss_fn_config applies to the named losses; a callable takes its options itself")
            return self._run_custom(data, loss_fn, backward=backward)
        if loss_fn not in NAMED_LOSSES:
            raise ValueError(f"unknown loss_fn {loss_fn!r}; pass one of {', '.join(NAMED_LOSSES)} or a callable")
        config = loss_config(loss_fn, loss_fn_config)
        names = self._inputs_of(data, loss_fn)
        batch, lengths = self._batch(data, names)
        key = ("fb" if backward else "f", loss_fn, tuple(sorted(config.items())), names, batch["input_ids"].shape)
        fn = self._compiled.get(key)
        if fn is None:
            objective = _make_named_objective(self.model_def, self.lora, loss_fn, config, names, self.vocab_chunk)
            fn = self._compiled[key] = jax.jit(
                _make_backward(objective) if backward else _make_forward(objective),
                donate_argnums=(3,) if backward else (),
            )
        dev = jax.device_put(batch, self._batch_sharding())
        if backward:
            grads = self._grads if self._grads is not None else self._zero_grads()
            loss, logp, metrics, self._grads = fn(self.params, self._frozen(), dev, grads)
            self._pending += 1
        else:
            loss, logp, metrics = fn(self.params, self._frozen(), dev)
        return _output(loss, logp, metrics, lengths)

    def _run_custom(self, data, loss_fn: Callable, *, backward: bool) -> ForwardOutput:
        from ptrain.train.objectives import target_stats

        _check_data(data)
        if not _all_have(data, "target_tokens"):
            raise ValueError("a callable loss_fn needs loss_fn_inputs['target_tokens'] in every datum")
        batch, lengths = self._batch(data, ("target_tokens",))
        model_def, spec, chunk = self.model_def, self.lora, self.vocab_chunk

        def logp_of(params, frozen, b):
            stats, _ = target_stats(model_def, _weights(params, frozen, spec), frozen["model_state"], b, chunk)
            return stats.logp

        key = ("logp", batch["input_ids"].shape)
        forward = self._compiled.get(key)
        if forward is None:
            forward = self._compiled[key] = jax.jit(logp_of)
        dev = jax.device_put(batch, self._batch_sharding())
        logp = forward(self.params, self._frozen(), dev)

        def user_loss(logp_BxL):
            out = loss_fn(list(data), [logp_BxL[i, :n] for i, n in enumerate(lengths)])
            loss, metrics = out if isinstance(out, tuple) else (out, {})
            return jnp.asarray(loss, jnp.float32).reshape(()), metrics

        (loss, metrics), cotangent = jax.value_and_grad(user_loss, has_aux=True)(logp)
        if backward:
            vkey = ("vjp", batch["input_ids"].shape)
            vjp_fn = self._compiled.get(vkey)
            if vjp_fn is None:

                def add_vjp(params, frozen, b, ct, acc):
                    _, pullback = jax.vjp(lambda p: logp_of(p, frozen, b), params)
                    return jax.tree.map(jnp.add, acc, pullback(ct)[0])

                vjp_fn = self._compiled[vkey] = jax.jit(add_vjp, donate_argnums=(4,))
            grads = self._grads if self._grads is not None else self._zero_grads()
            self._grads = vjp_fn(self.params, self._frozen(), dev, cotangent, grads)
            self._pending += 1
        metrics = dict(metrics or {}, **{"loss:sum": loss})
        return _output(loss, logp, metrics, lengths)

    def _zero_grads(self):
        fn = self._compiled.get("zeros")
        if fn is None:
            fn = self._compiled["zeros"] = jax.jit(
                lambda p: jax.tree.map(jnp.zeros_like, p), out_shardings=self._param_sh
            )
        return fn(self.params)

    def _batch_sharding(self):
        from ptrain.parallel import batch_sharding

        return batch_sharding(self.mesh)


# ------------------------------------------------------------------------ pure functions


def _weights(params, frozen: dict, spec):
    """The module's param tree: `params`, or under LoRA the frozen base with them attached."""
    if spec is None:
        return params
    from ptrain.models.lora import attach

    return attach(frozen["base"], params, spec)


def _make_named_objective(model_def, spec, loss: str, config: dict, names: tuple[str, ...], vocab_chunk: int):
    """params, frozen ({"base", "model_state"}), batch -> (loss, (logp [B, L], metrics))."""
    from ptrain.train.objectives import target_stats

    def objective(params, frozen, batch):
        stats, _ = target_stats(model_def, _weights(params, frozen, spec), frozen["model_state"], batch, vocab_chunk)
        inputs = {k: batch[k] for k in names if k != "target_tokens"}
        value, metrics = named_loss(loss, stats.logp, inputs, batch["valid"], config)
        return value, (stats.logp, metrics)

    return objective


def _make_forward(objective):
    def forward(params, frozen, batch):
        loss, (logp, metrics) = objective(params, frozen, batch)
        return loss, logp, metrics

    return forward


def _make_backward(objective):
    def backward(params, frozen, batch, acc):
        (loss, (logp, metrics)), grads = jax.value_and_grad(objective, has_aux=True)(params, frozen, batch)
        return loss, logp, metrics, jax.tree.map(jnp.add, acc, grads)

    return backward


def _make_apply(tx):
    """(params, opt_state, grads, hyperparameters) -> (params, opt_state, grad norm): the
    stages' update (clip by global norm, then AdamW) with per-call hyperparameters."""

    def apply(params, opt_state, grads, hp):
        norm = optax.global_norm(grads)
        clip = hp["clip"]
        scale = jnp.where((clip > 0) & (norm >= clip), clip / jnp.maximum(norm, 1e-30), 1.0)
        grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
        hyper = dict(opt_state.hyperparams)
        for k in ("learning_rate", "b1", "b2", "eps", "weight_decay"):
            hyper[k] = hp[k].astype(jnp.asarray(hyper[k]).dtype)
        opt_state = opt_state._replace(hyperparams=hyper)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, norm

    return apply


def _output(loss, logp, metrics, lengths) -> ForwardOutput:
    logp = np.asarray(logp)
    return ForwardOutput(
        logprobs=[logp[i, :n].astype(np.float32) for i, n in enumerate(lengths)],
        loss=float(loss),
        metrics={k: float(v) for k, v in metrics.items()},
    )


def _adam_params(p: AdamParams | Mapping[str, float] | None) -> AdamParams:
    if p is None:
        return AdamParams()
    if isinstance(p, Mapping):
        unknown = sorted(set(p) - {f.name for f in dataclasses.fields(AdamParams)})
        if unknown:
            raise ValueError(
                f"adam_params {unknown} are unknown; pass {[f.name for f in dataclasses.fields(AdamParams)]}"
            )
        p = AdamParams(**p)
    checks = (
        (p.learning_rate >= 0, "learning_rate must be >= 0"),
        (0 <= p.beta1 < 1 and 0 <= p.beta2 < 1, "beta1 and beta2 must be in [0, 1)"),
        (p.eps > 0, "eps must be > 0"),
        (p.weight_decay >= 0, "weight_decay must be >= 0"),
        (p.grad_clip_norm >= 0, "grad_clip_norm must be >= 0 (0: no clipping)"),
    )
    for ok, message in checks:
        if not ok:
            raise ValueError(f"adam_params: {message}, got {p}")
    return p


def _check_data(data) -> None:
    if isinstance(data, Datum) or not isinstance(data, Sequence) or not len(data):
        raise ValueError("pass a non-empty list of Datum")
    for i, d in enumerate(data):
        if not isinstance(d, Datum):
            raise TypeError(f"datum {i} is a {type(d).__name__}; pass ptrain.Datum(tokens, loss_fn_inputs)")


def _all_have(data, name: str) -> bool:
    return all(name in (getattr(d, "loss_fn_inputs", {}) or {}) for d in data)


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()
