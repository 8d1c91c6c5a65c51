"""``glm5-dsa train-indexer``: train a layer's lightning indexer from its KL loss, DeepSeek-V3.2's
two stages (a dense warm-up, then sparse training), on synthetic prompts, with a resumable
train state and a report of the attention mass the selection captures, before and after.

What a run does (``train_indexer``): re-initialise the indexer (``reinit_indexer``, seeded),
then for ``warmup_steps`` steps the dense stage (``layer(x, attention="dense",
indexer_loss="dense")``: the main attention over every visible token, the KL over every
complete pool) and for ``sparse_steps`` steps the sparse stage (``attention="sparse",
indexer_loss="sparse"``: the KL over the selected pools), each step one ``optax.adam`` update of
the indexer's parameters only (``INDEXER_PARAMS``; the loss reaches no other parameter, the
layer routes it so). Progress goes to a tqdm bar.

Invariants:

* **A resumed run is the uninterrupted run.** Step ``k``'s prompts are a pure function of
  ``(seed, k)`` (``SyntheticPrompts.train``), its stage a function of ``k``
  (``TrainSettings.stage``), and the train state (indexer parameters, optimiser state, step)
  is saved by orbax every ``save_every`` steps and at the end: resuming from step ``k``
  continues with exactly the losses an uninterrupted run has from ``k`` on (tested). A
  resume with different settings (``RUN_FILE``) is refused, naming the setting.
* **Nothing half-written.** orbax writes each step's state to a temporary directory and
  renames it when complete (an interrupted save leaves the previous step); ``out`` holding
  something else than a train state is refused before any work.
* **The metric** (``captured_mass``): per query, the dense head-mean attention mass
  (``dense_pool_mass``) on the pools the indexer selects (the layer's ``topk``) over the mass
  on the best ``select_k`` pools it could have selected, averaged over the queries that have
  a choice (more complete visible pools than ``select_k``: the others select every pool and
  capture everything by construction). 1.0 is the best possible selection.
* **Why synthetic prompts of repeated words** (``SyntheticPrompts``): a random layer's
  attention over random hidden states is nearly uniform, so any selection captures about
  what the best does and there is nothing to learn. Prompts made of runs of ``kpool`` copies
  of one of ``vocab`` random "word" embeddings (plus a little noise) give every head
  content-based preferences (a query word attends to the key words it scores highest), so a
  query's attention is peaked on the pools of a few words, a random indexer misses most of
  them, and the best top-k is learnable from the prompt's content. Runs aligned with the pool
  grid make each pool one word. The measured rise from the random indexer's captured mass is
  in docs/training.md, "Training the indexer".
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from glm5_dsa_jax.checkpoint import load_for_demo, save_checkpoint
from glm5_dsa_jax.model.attention_mass import dense_pool_mass
from glm5_dsa_jax.model.config import DsaConfig
from glm5_dsa_jax.model.indexer_loss import INDEXER_PARAMS
from glm5_dsa_jax.model.layer import DsaAttention, DsaIndexer

__all__ = ["TrainSettings", "SyntheticPrompts", "build_layer", "reinit_indexer", "captured_mass",
           "train_indexer", "load_train_state", "check_out", "STAGES", "STATE_DIR", "RUN_FILE", "LAYER_DIR",
           "SAVE_EVERY", "EVAL_PROMPTS", "SettingsMismatch"]

#: The two stages, in order: (the layer's ``attention=``, its ``indexer_loss=``) of each.
STAGES: dict[str, tuple[str, str]] = {"dense": ("dense", "dense"), "sparse": ("sparse", "sparse")}
#: Under ``out``: the orbax train states (one directory per saved step), the run's settings,
#: and the trained layer at the end (a ``save_checkpoint`` directory: ``glm5-dsa demo
#: --checkpoint OUT/layer`` runs it).
STATE_DIR, RUN_FILE, LAYER_DIR = "state", "run.json", "layer"
#: Train states kept (the newest): the last complete one survives an interrupted save.
KEEP_STATES = 2
#: ``train_indexer``'s (and the CLI's) defaults: steps between saved states, held-out prompts.
SAVE_EVERY, EVAL_PROMPTS = 50, 4


class SettingsMismatch(ValueError):
    """``--resume`` of a run whose settings differ (the message names each)."""


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """What determines a run's losses (saved as ``RUN_FILE``; a resume must match).

    ``warmup_steps`` dense then ``sparse_steps`` sparse steps of ``batch`` prompts of ``tokens``
    tokens; adam at ``lr``; ``seed`` seeds the indexer's re-initialisation and the prompts;
    ``vocab`` words in the prompts (``SyntheticPrompts``); ``source`` names the layer (a
    preset or a checkpoint, and its index)."""
    warmup_steps: int
    sparse_steps: int
    batch: int
    tokens: int
    lr: float = 1e-3
    seed: int = 0
    vocab: int = 16
    source: str = ""

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.sparse_steps

    def stage(self, step: int) -> str:
        """Step ``step``'s stage (0-based): ``"dense"`` for the warm-up, then ``"sparse"``."""
        return "dense" if step < self.warmup_steps else "sparse"

    def check(self, cfg: DsaConfig) -> None:
        """``ValueError`` naming the setting unless ``cfg`` can train with these: counts
        positive (a stage may have 0 steps, not both), ``tokens`` within the positions and
        long enough that a query has a choice (more complete pools than ``select_k``)."""
        for name in ("warmup_steps", "sparse_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.total_steps == 0:
            raise ValueError("warmup_steps + sparse_steps is 0: nothing to train")
        for name in ("batch", "tokens", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.tokens > cfg.max_position_embeddings:
            raise ValueError(f"tokens {self.tokens:,} exceed max_position_embeddings="
                             f"{cfg.max_position_embeddings:,}")
        least = (cfg.max_select_k + 1) * cfg.index_kpool
        if self.tokens < least:
            raise ValueError(f"tokens {self.tokens} leave no query a choice: at least {least} "
                             f"({cfg.max_select_k} + 1 pools of {cfg.index_kpool}) are needed")


class SyntheticPrompts:
    """Hidden states ``[B, S, hidden]`` float32 made of words (module doc, "why"): ``vocab``
    random embeddings (the table drawn from ``seed``), each prompt a sequence of runs of
    ``kpool`` copies of a uniformly drawn word, plus Gaussian noise of std ``noise``.

    ``train(step, ...)`` and ``held_out(...)`` draw from disjoint streams (``numpy``'s
    ``SeedSequence`` of ``(seed, stream, step)``): a step's prompts depend on nothing but
    its index, which is what makes a resumed run the uninterrupted one."""

    TRAIN, HELD_OUT = 0, 1

    def __init__(self, cfg: DsaConfig, seed: int, vocab: int = TrainSettings.vocab, noise: float = 0.1):
        self.cfg, self.seed, self.vocab, self.noise = cfg, seed, vocab, noise
        self.words = np.random.default_rng([seed, 7]).standard_normal((vocab, cfg.hidden_size)).astype(np.float32)

    def _draw(self, rng: np.random.Generator, batch: int, tokens: int) -> np.ndarray:
        kp = self.cfg.index_kpool
        words = np.repeat(rng.integers(0, self.vocab, (batch, -(-tokens // kp))), kp, axis=1)[:, :tokens]
        noise = rng.standard_normal((batch, tokens, self.cfg.hidden_size)).astype(np.float32)
        return self.words[words] + self.noise * noise

    def train(self, step: int, batch: int, tokens: int) -> np.ndarray:
        """Training step ``step``'s prompts."""
        return self._draw(np.random.default_rng([self.seed, self.TRAIN, step]), batch, tokens)

    def held_out(self, batch: int, tokens: int) -> np.ndarray:
        """The evaluation prompts (never trained on)."""
        return self._draw(np.random.default_rng([self.seed, self.HELD_OUT]), batch, tokens)


def build_layer(preset: str = "tiny", checkpoint: str | None = None, layer_idx: int | None = None,
                implementation: str = "xla", seed: int = 0) -> DsaAttention:
    """The layer to train: a full layer of ``preset`` (random weights ``nnx.Rngs(seed +
    layer_idx)``, float32 at tiny, else bf16) or of ``checkpoint`` (orbax or HF directory).
    ``layer_idx`` None: the first full layer. ``ValueError`` when it is no full layer (a
    ``"shared"`` layer has no indexer to train) or not in the checkpoint."""
    if checkpoint:
        cfg, layers = load_for_demo(checkpoint, implementation=implementation)
    else:
        cfg, layers = DsaConfig.preset(preset), None
    fulls = [i for i in cfg.dsa_layers if cfg.has_indexer(i) and (layers is None or i in layers)]
    if layer_idx is None:
        if not fulls:
            raise ValueError("no full-indexer DSA layer to train (a 'shared' layer has no indexer)")
        layer_idx = fulls[0]
    if layer_idx not in fulls:
        raise ValueError(f"layer {layer_idx} is no full-indexer DSA layer of "
                         f"{'checkpoint ' + repr(checkpoint) if checkpoint else 'preset ' + preset}: "
                         f"expected one of {fulls}")
    if layers is not None:
        return layers[layer_idx]
    dtype = jnp.float32 if preset == "tiny" else jnp.bfloat16
    return DsaAttention(cfg, layer_idx, rngs=nnx.Rngs(seed + layer_idx), implementation=implementation,
                        dtype=dtype, param_dtype=dtype)


def reinit_indexer(layer: DsaAttention, seed: int) -> None:
    """Replace the indexer's parameters by a fresh random initialisation (``nnx.Rngs(seed)``,
    the layout table's initialisers, the layer's parameter dtype), in place."""
    if layer.indexer is None:
        raise ValueError(f"layer {layer.layer_idx} is a 'shared' layer: it has no indexer")
    fresh = DsaIndexer(layer.cfg, rngs=nnx.Rngs(seed), param_dtype=layer.indexer.wk[...].dtype)
    nnx.update(layer.indexer, nnx.state(fresh, nnx.Param))


# ---------------------------------------------------------------------------- the metric
def captured_mass(layer: DsaAttention, x, mask=None) -> dict:
    """The selection's captured mass on prompts ``x [B, S, hidden]`` (``mask [B, S]``, None =
    all valid): ``captured`` = mean over the queries with a choice of (mass on the selected
    pools) / (mass on the best ``select_k`` pools) (module doc), ``best`` = the mean best
    mass itself (how peaked the attention is), ``queries`` = how many were counted."""
    cfg, kp, k = layer.cfg, layer.cfg.index_kpool, layer.cfg.max_select_k
    x = jnp.asarray(x, layer.dtype)
    b, s, _ = x.shape
    mask = jnp.ones((b, s), bool) if mask is None else jnp.asarray(mask, bool)
    _, topk = layer(x, attention_mask=mask)
    graphdef, state = nnx.split(layer)
    mass = np.asarray(_pool_mass_fn(graphdef)(state, x, mask), np.float64)  # [B, S, P]
    first_key = np.asarray(jnp.argmax(mask, axis=1))  # a fresh cache's pool grid: the first valid slot
    topk, valid = np.asarray(topk), np.asarray(mask)
    n_pools = mass.shape[-1]
    t = np.arange(s)[None, :]
    complete = np.clip((t - first_key[:, None] + 1) // kp, 0, n_pools)  # [B, S] pools ending by t
    pool = np.arange(n_pools)[None, None, :]
    visible = np.where(pool < complete[..., None], mass, -np.inf)
    best = -np.sort(-visible, axis=-1)[..., :k]
    best = np.where(np.isfinite(best), best, 0).sum(-1)
    ids = topk[..., : k * kp : kp]  # the selected pools come first, kpool tokens each
    sel_pool = np.where(ids >= 0, (ids - first_key[:, None, None]) // kp, -1)
    sel = np.where(sel_pool >= 0, np.take_along_axis(mass, np.maximum(sel_pool, 0), -1), 0).sum(-1)
    counted = valid & (complete > k) & (best > 0)
    n = int(counted.sum())
    if n == 0:
        raise ValueError(f"no query of these prompts has a choice: need more than {k} complete pools")
    return {"captured": float((sel / np.where(counted, best, 1))[counted].mean()),
            "best": float(best[counted].mean()), "queries": n}


@functools.lru_cache(maxsize=16)
def _pool_mass_fn(graphdef):
    """``_pool_mass`` jitted, once per layer structure: ``(state, x, mask) -> [B, S, P]``."""
    return jax.jit(lambda state, x, mask: _pool_mass(nnx.merge(graphdef, state), x, mask))


def _pool_mass(layer: DsaAttention, x, mask):
    """``[B, S, P]`` the dense head-mean attention mass per pool (``dense_pool_mass``) of the
    layer's queries over the prompt's rows, as a fresh cache holds them."""
    cfg = layer.cfg
    b, s, _ = x.shape
    slots = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None], (b, s))
    x = jnp.where(mask[..., None], x, jnp.zeros((), x.dtype))
    _, q_lat, latent = layer.project(x, layer.rope(slots))
    q_slots = jnp.where(mask, slots, -1)
    return dense_pool_mass(q_lat, latent, q_slots, mask, jnp.argmax(mask, axis=1).astype(jnp.int32),
                           kpool=cfg.index_kpool, n_pools=s // cfg.index_kpool, scale=cfg.softmax_scale)


# ---------------------------------------------------------------------------- training
@functools.lru_cache(maxsize=16)
def _step_fn(graphdef, lr: float, stage: str):
    """The jitted training step of ``stage``: ``(params, opt_state, rest, x, mask) ->
    (params, opt_state, loss)``, one ``optax.adam(lr)`` update of the indexer's parameters
    ``params`` from the layer's indexer loss (``rest``: the layer's other state, an argument
    so it is not baked into the program). Cached per layer structure (``graphdef``), so a
    second run in a process (a resume, the notebook's) compiles nothing."""
    attention, indexer_loss = STAGES[stage]
    tx = optax.adam(lr)

    def loss_fn(params, rest, x, mask):
        layer = nnx.merge(graphdef, params, rest)
        _, _, loss = layer(x, attention_mask=mask, attention=attention, indexer_loss=indexer_loss)
        return loss

    @jax.jit
    def step(params, opt_state, rest, x, mask):
        loss, grads = jax.value_and_grad(loss_fn)(params, rest, x, mask)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def _leaves(tree) -> dict:
    """A train state as orbax saves it: ``{"0000": leaf, ...}`` in ``jax.tree`` order (the
    template a resume rebuilds it into has the same structure: the same layer and optimiser)."""
    return {f"{i:04d}": leaf for i, leaf in enumerate(jax.tree.leaves(tree))}


def _orbax():
    """``orbax.checkpoint``, imported on first use (1-2 s: every ``glm5-dsa`` command would
    pay it at start-up)."""
    import orbax.checkpoint as ocp

    return ocp


def _manager(out: Path):
    ocp = _orbax()
    return ocp.CheckpointManager(
        (out / STATE_DIR).resolve(), options=ocp.CheckpointManagerOptions(max_to_keep=KEEP_STATES, create=True))


def load_train_state(out, template):
    """``(step, state)``: the newest train state under ``out`` restored into ``template``'s
    structure (``(params, opt_state)``), or ``(0, template)`` when there is none."""
    out = Path(out)
    if not (out / STATE_DIR).is_dir():
        return 0, template
    ocp = _orbax()
    mgr = _manager(out)
    try:
        step = mgr.latest_step()
        if step is None:
            return 0, template
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _leaves(template))
        restored = mgr.restore(step, args=ocp.args.StandardRestore(abstract))
    finally:
        mgr.close()
    treedef = jax.tree.structure(template)
    return int(step), jax.tree.unflatten(treedef, [restored[k] for k in sorted(restored)])


def check_out(out: Path | None, settings: TrainSettings, resume: bool) -> None:
    """Before any work: ``out`` is fresh (absent or empty) for a new run; for ``resume`` it
    holds a run with the same settings (``SettingsMismatch`` naming each difference)."""
    if out is None:
        if resume:
            raise ValueError("resume needs out (the directory of the run to resume)")
        return
    run_file = out / RUN_FILE
    if not resume:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            what = "holds a run (pass resume=True to continue it)" if run_file.is_file() else "is not empty"
            raise ValueError(f"out {str(out)!r} {what}")
        return
    if not run_file.is_file():
        raise ValueError(f"resume: {str(out)!r} holds no run ({RUN_FILE} missing)")
    saved = json.loads(run_file.read_text())
    now = dataclasses.asdict(settings)
    diff = [f"{k} {saved.get(k)!r} -> {v!r}" for k, v in now.items() if saved.get(k) != v]
    if diff:
        raise SettingsMismatch(f"resume: the run in {str(out)!r} has other settings: {'; '.join(diff)}")


def _write_run_file(out: Path, settings: TrainSettings) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{RUN_FILE}.partial"
    tmp.write_text(json.dumps(dataclasses.asdict(settings), indent=1))
    tmp.replace(out / RUN_FILE)


def train_indexer(layer: DsaAttention, settings: TrainSettings, *, out=None, resume: bool = False,
                  save_every: int = SAVE_EVERY, eval_prompts: int = EVAL_PROMPTS, eval_every: int | None = None,
                  callback: Callable[[dict], None] | None = None, progress: bool = True) -> dict:
    """Train ``layer``'s indexer in place (module doc) and return the report.

    Args:
      layer: a full DSA layer (its indexer is re-initialised from ``settings.seed`` first).
      settings: the run (``TrainSettings``).
      out: a directory for the train state (saved every ``save_every`` steps and at the
        end), ``RUN_FILE`` and the trained layer (``LAYER_DIR``); None saves nothing.
      resume: continue the run saved in ``out`` from its newest state.
      eval_prompts: held-out prompts the captured mass is measured on.
      eval_every: also measure it every this many steps (the records' ``"captured"``).
      callback: called after each step with its record ``{"step": steps done, "stage",
        "loss"[, "captured"]}`` (the notebook plots them); an exception stops the run (the
        states saved so far stay).
      progress: a tqdm bar over the steps.

    Returns ``{"settings", "layer_idx", "before", "after", "records", "start_step",
    "seconds"}``: ``before`` / ``after`` are ``captured_mass`` on the held-out prompts with
    the re-initialised and the trained indexer."""
    cfg = layer.cfg
    if layer.indexer is None:
        raise ValueError(f"layer {layer.layer_idx} is a 'shared' layer: it has no indexer to train")
    settings.check(cfg)
    for name, v in (("save_every", save_every), ("eval_prompts", eval_prompts)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    out = None if out is None else Path(out)
    check_out(out, settings, resume)
    t0 = time.perf_counter()
    prompts = SyntheticPrompts(cfg, settings.seed, settings.vocab)
    held = prompts.held_out(eval_prompts, settings.tokens)
    reinit_indexer(layer, settings.seed)
    before = captured_mass(layer, held)
    graphdef, params, rest = nnx.split(layer, INDEXER_PARAMS, ...)
    tx = optax.adam(settings.lr)
    start, (params, opt_state) = 0, (params, tx.init(params))
    if resume:
        start, (params, opt_state) = load_train_state(out, (params, opt_state))
    elif out is not None:
        _write_run_file(out, settings)
    steps = {stage: _step_fn(graphdef, settings.lr, stage) for stage in STAGES}
    mask = jnp.ones((settings.batch, settings.tokens), bool)
    records = []
    mgr = _manager(out) if out is not None else None
    try:
        bar = tqdm(range(start, settings.total_steps), desc="train-indexer", unit="step",
                   disable=not progress, leave=False)
        for k in bar:
            stage = settings.stage(k)
            x = jnp.asarray(prompts.train(k, settings.batch, settings.tokens), layer.dtype)
            params, opt_state, loss = steps[stage](params, opt_state, rest, x, mask)
            rec = {"step": k + 1, "stage": stage, "loss": float(loss)}
            if eval_every and (k + 1) % eval_every == 0:
                nnx.update(layer, params)
                rec["captured"] = captured_mass(layer, held)["captured"]
            bar.set_postfix(stage=stage, loss=f"{rec['loss']:.4f}")
            if mgr is not None and ((k + 1) % save_every == 0 or k + 1 == settings.total_steps):
                mgr.save(k + 1, args=_orbax().args.StandardSave(_leaves((params, opt_state))))
                mgr.wait_until_finished()
            records.append(rec)
            if callback is not None:
                callback(rec)
    finally:
        if mgr is not None:
            mgr.close()
    nnx.update(layer, params)
    after = captured_mass(layer, held)
    if out is not None:
        save_checkpoint({layer.layer_idx: layer}, out / LAYER_DIR, overwrite=True)  # ours: a resume rewrites it
    return {"settings": dataclasses.asdict(settings), "layer_idx": layer.layer_idx, "before": before,
            "after": after, "records": records, "start_step": start,
            "seconds": round(time.perf_counter() - t0, 2)}
