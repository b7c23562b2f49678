"""Shared pieces of the training examples: flags, data, the loop, the report.

``llama_equinox.py`` and ``llama_flax.py`` build their model and a jitted
``train_step(state, batch, key) -> (state, loss)`` and hand both to
``run_training``, which feeds byte-level batches of the prepared corpus
(``text_data.py``), evaluates the held-out split, and reports -- like
MaxText -- step time, TFLOP/s per device and tokens/s per device, so runs at
different precisions compare at a glance. Each run writes ``<out>/<label>.csv``;
``plot_curves`` draws several runs' loss curves into one PNG.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_nvfp4 as nv

__all__ = [
    "NVFP4_LAYERS",
    "PRECISIONS",
    "add_common_flags",
    "batches",
    "eval_batches",
    "llama_flops_per_token",
    "load_splits",
    "make_optimizer",
    "plot_curves",
    "run_training",
    "summarize",
    "worst_operands",
    "write_operand_stats",
]

# --precision name -> the recipe of the layers the policy puts in NVFP4 (None:
# every layer in bf16). Past the presets, the ablations that find which part of
# the recipe, or which GEMM's quantization, moves the loss: 1x16 weight blocks
# instead of 16x16, and one GEMM at a time kept in bf16.
PRECISIONS: dict[str, nv.Recipe | None] = {
    "bf16": None,
    "nvfp4": nv.NVFP4,
    "nvfp4_no_rht": nv.NVFP4_NO_RHT,
    "nvfp4_no_sr": nv.NVFP4_NO_SR,
    "nvfp4_1d_weights": nv.Recipe(weight_2d=False),
    "nvfp4_bf16_fprop": nv.Recipe(fprop=False),
    "nvfp4_bf16_dgrad": nv.Recipe(dgrad=False),
    "nvfp4_bf16_wgrad": nv.Recipe(wgrad=False),
}

# --nvfp4-layers name -> the policy's NVFP4 path patterns in the examples'
# models (their blocks name the MLP or mixture "mlp", attention "attn").
NVFP4_LAYERS: dict[str, tuple[str, ...]] = {
    "mlp": ("*mlp*",),
    "mlp+attn": ("*mlp*", "*attn*"),
}

# Columns of the per-run CSV (one row per logged step).
CSV_FIELDS = (
    "step",
    "loss",
    "train_loss",
    "eval_loss",
    "lr",
    "step_ms",
    "tflops_per_device",
    "tokens_per_s_per_device",
    "elapsed_s",
)


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    """Adds the flags every example shares.

    The defaults are a tiny model (2 layers, d_model 64, ~100K parameters) that
    trains for 120 steps on the CPU in about a minute; the convergence run
    (benchmarks/convergence.py) passes GPU-sized values.
    """
    parser.add_argument(
        "--precision",
        choices=sorted(PRECISIONS),
        default="nvfp4",
        help="bf16 everywhere, or the NVFP4 recipe on the layers the policy "
        "selects: full, without the Random Hadamard Transform, without "
        "stochastic rounding, with 1x16 weight blocks, or with one GEMM "
        "(FPROP, DGRAD or WGRAD) kept in bf16",
    )
    parser.add_argument(
        "--nvfp4-layers",
        choices=sorted(NVFP4_LAYERS),
        default="mlp",
        help="the linears the policy puts in NVFP4: the MLPs' (the recipe's "
        "choice; experts' projections too), or the attention projections' too",
    )
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument(
        "--seq-len", type=int, default=64, help="tokens (bytes) per sequence"
    )
    parser.add_argument("--d-model", type=int, default=64, help="model width")
    parser.add_argument("--layers", type=int, default=2, help="decoder blocks")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument(
        "--ffn", type=int, default=192, help="SwiGLU hidden width (multiple of 16)"
    )
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument(
        "--warmup", type=int, default=12, help="linear warmup steps (then cosine)"
    )
    parser.add_argument("--weight-decay", type=float, default=0.1, help="AdamW")
    parser.add_argument("--seed", type=int, default=0, help="init, data and SR keys")
    parser.add_argument(
        "--data",
        default=".data/corpus.bin",
        help="prepared corpus (python examples/text_data.py prepare); when the "
        "file is missing, the small sample in tests/data is used with a warning",
    )
    parser.add_argument("--out", default="runs", help="directory for <label>.csv")
    parser.add_argument("--log-every", type=int, default=10, help="steps per row")
    parser.add_argument(
        "--eval-every", type=int, default=40, help="steps between held-out evals"
    )
    parser.add_argument(
        "--eval-batches", type=int, default=4, help="held-out batches per eval"
    )
    parser.add_argument(
        "--experts",
        type=int,
        default=0,
        help="MoE: SwiGLU experts per block (0: a dense MLP); the policy puts "
        "the expert projections in NVFP4 like the MLP's, the router stays bf16",
    )
    parser.add_argument("--top-k", type=int, default=2, help="MoE: experts per token")
    parser.add_argument(
        "--keep-last",
        type=int,
        default=1,
        help="the last N decoder blocks stay in bf16 (the policy's keep_last)",
    )


# --------------------------------------------------------------------- data


def load_splits(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray]:
    """(train, held_out) uint8 byte tokens (vocab 256) of ``args.data``."""
    from nvfp4_examples import text_data

    path = args.data
    if not os.path.exists(path):
        print(
            f"warning: {path} not found (build it with `python "
            f"examples/text_data.py prepare --out {os.path.dirname(path) or '.'}`); "
            "training on the few-KB sample in tests/data instead",
            file=sys.stderr,
        )
        return text_data.load_sample()
    return text_data.load_corpus(path)


def _check_window(tokens: np.ndarray, seq_len: int, name: str) -> None:
    if tokens.ndim != 1 or tokens.dtype != np.uint8:
        raise TypeError(f"{name} must be a 1-D uint8 array, got {tokens.dtype}")
    if tokens.size < seq_len + 1:
        raise ValueError(
            f"{name} has {tokens.size} bytes, fewer than one window of "
            f"seq_len + 1 = {seq_len + 1}; use a shorter --seq-len or more data"
        )


def batches(
    tokens: np.ndarray, batch: int, seq_len: int, seed: int
) -> Iterator[np.ndarray]:
    """Endless random windows of the byte stream: int32 [batch, seq_len + 1].

    Each row is ``tokens[s : s + seq_len + 1]`` for a start ``s`` drawn
    uniformly (with replacement) from a generator seeded by ``seed``; inputs
    are ``row[:-1]`` and targets ``row[1:]``.
    """
    _check_window(tokens, seq_len, "tokens")
    rng = np.random.default_rng(seed)
    offsets = np.arange(seq_len + 1)
    while True:
        starts = rng.integers(0, tokens.size - seq_len, size=batch)
        yield tokens[starts[:, None] + offsets].astype(np.int32)


def eval_batches(
    tokens: np.ndarray, batch: int, seq_len: int, count: int
) -> list[np.ndarray]:
    """``count`` fixed held-out batches: windows evenly spaced over ``tokens``.

    The same windows are used at every evaluation, so held-out losses of one
    run (and of runs at different precisions) are comparable.
    """
    _check_window(tokens, seq_len, "held-out tokens")
    n = batch * count
    starts = np.linspace(0, tokens.size - seq_len - 1, n).astype(np.int64)
    rows = tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
    return list(rows.reshape(count, batch, seq_len + 1))


# ---------------------------------------------------------------- optimizer


def make_optimizer(args: argparse.Namespace):
    """AdamW (b2 0.95) with linear warmup to ``args.lr`` then cosine decay to
    10% of it, gradient clipping at global norm 1. Returns (optimizer,
    schedule)."""
    import optax

    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=args.lr,
        warmup_steps=max(1, min(args.warmup, args.steps - 1)),
        decay_steps=max(2, args.steps),
        end_value=args.lr * 0.1,
    )
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay),
    )
    return optimizer, schedule


# -------------------------------------------------------------------- FLOPs


def llama_flops_per_token(
    *, d_model: int, layers: int, ffn: int, seq_len: int, vocab: int = 256
) -> float:
    """Training FLOPs per token of a Llama-style decoder, as MaxText counts them.

    6 FLOPs per matmul parameter per token (2 forward, 4 backward) over the
    attention projections (q, k, v, o: 4 d^2 per layer), the SwiGLU MLP (gate,
    up, down: 3 d ffn per layer) and the output head (d vocab); plus causal
    attention: QK^T and AV cost 2 * 2 * seq_len * d per token and layer
    forward, halved by the causal mask, times 3 for forward and backward,
    i.e. 6 * seq_len * d per layer. Embedding lookups, norms and the softmax
    are not counted.
    """
    matmul_params = layers * (4 * d_model * d_model + 3 * d_model * ffn)
    matmul_params += d_model * vocab
    attention = 6 * layers * seq_len * d_model
    return float(6 * matmul_params + attention)


# --------------------------------------------------------------------- loop


class _Progress:
    """A one-line progress bar on stderr (only when stderr is a terminal)."""

    def __init__(self, label: str, total: int):
        self.label, self.total = label, total
        self.enabled = sys.stderr.isatty()
        self.status = ""

    def update(self, step: int) -> None:
        if not self.enabled:
            return
        width = 30
        done = int(width * step / max(1, self.total))
        bar = "#" * done + "." * (width - done)
        sys.stderr.write(f"\r{self.label} [{bar}] {step}/{self.total} {self.status}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _eval(eval_loss, state, held: list[np.ndarray]) -> float:
    losses = [eval_loss(state, jnp.asarray(b)) for b in held]
    return float(np.mean(jax.device_get(losses)))


def run_training(
    *,
    label: str,
    args: argparse.Namespace,
    train_step: Callable[[Any, jax.Array, jax.Array], tuple[Any, jax.Array]],
    state: Any,
    flops_per_token: float,
    eval_loss: Callable[[Any, jax.Array], jax.Array] | None = None,
    schedule: Callable[[int], Any] | None = None,
    on_done: Callable[[Any], None] | None = None,
) -> list[dict]:
    """Trains for ``args.steps`` steps and records the run.

    Args:
      label: the run's name; the CSV is ``<args.out>/<label>.csv``.
      args: the parsed common flags.
      train_step: jitted ``(state, batch int32 [B, S + 1], key) -> (state,
        loss)``; ``key`` is ``fold_in(key(args.seed + 1), step)``, new each step
        (for stochastic rounding).
      state: the initial training state (parameters and optimizer state).
      flops_per_token: training FLOPs per token (``llama_flops_per_token``).
      eval_loss: optional jitted ``(state, batch) -> loss`` for the held-out
        split, run every ``args.eval_every`` steps and after the last step.
      schedule: optional learning-rate schedule, only for the CSV.
      on_done: optional, called with the final state after the last step.

    Every ``args.log_every`` steps a row is printed and appended to the CSV:
    the step's loss, the mean training loss since the previous row, the
    held-out loss (when evaluated), the learning rate, the mean step time since
    the previous row (the first step, which compiles, is timed separately and
    excluded; evaluation time is excluded), TFLOP/s and tokens/s per device.
    Raises FloatingPointError (after writing the rows so far) as soon as a
    training loss is NaN or infinite.

    Returns:
      The rows, dicts keyed by CSV_FIELDS (the compile time is printed, not
      recorded).
    """
    if args.steps < 1 or args.log_every < 1 or args.eval_every < 1:
        raise ValueError("--steps, --log-every and --eval-every must be >= 1")
    train, held_out = load_splits(args)
    data = batches(train, args.batch, args.seq_len, args.seed)
    held = (
        eval_batches(held_out, args.batch, args.seq_len, args.eval_batches)
        if eval_loss is not None
        else []
    )
    tokens_per_step = args.batch * args.seq_len
    base_key = jax.random.key(args.seed + 1)
    print(
        f"{label}: {args.steps} steps of {args.batch} x {args.seq_len} tokens; "
        f"corpus {train.size:,} train / {held_out.size:,} held-out bytes "
        f"({args.steps * tokens_per_step / train.size:.2f} epochs); "
        f"{flops_per_token * tokens_per_step / 1e9:.2f} GFLOP/step",
        flush=True,
    )

    os.makedirs(args.out, exist_ok=True)
    csv_path = os.path.join(args.out, f"{label}.csv")
    records: list[dict] = []
    progress = _Progress(label, args.steps)
    start = time.perf_counter()
    window: list[jax.Array] = []
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        t0 = start  # start of the current timing window
        timed_steps = 0  # steps in it (the first, compiling step is not)
        for step in range(1, args.steps + 1):
            batch = jnp.asarray(next(data))
            state, loss = train_step(state, batch, jax.random.fold_in(base_key, step))
            window.append(loss)
            if step == 1:
                first = float(loss)  # waits for compilation and one step
                print(
                    f"{label}: first step (compilation included) "
                    f"{time.perf_counter() - start:.1f} s",
                    flush=True,
                )
                if not math.isfinite(first):
                    _stop_nonfinite(label, step, first, progress)
                t0 = time.perf_counter()
            else:
                timed_steps += 1
            progress.update(step)
            is_last = step == args.steps
            do_eval = eval_loss is not None and (step % args.eval_every == 0 or is_last)
            if step % args.log_every and not is_last and not do_eval:
                continue
            # Fetching the losses waits for the device: the window's time is
            # the time of its steps (dispatch runs ahead otherwise).
            losses = np.asarray(jax.device_get(window), np.float64)
            now = time.perf_counter()
            step_s = (now - t0) / timed_steps if timed_steps else math.nan
            row = _row(step, losses, step_s, now - start, loss, args, flops_per_token)
            if schedule is not None:
                row["lr"] = float(schedule(step - 1))
            bad = np.flatnonzero(~np.isfinite(losses))
            if bad.size:
                writer.writerow(row)
                f.flush()
                first_bad = step - losses.size + 1 + int(bad[0])
                _stop_nonfinite(label, first_bad, losses[bad[0]], progress)
            if do_eval:
                row["eval_loss"] = _eval(eval_loss, state, held)
            records.append(row)
            writer.writerow(row)
            f.flush()
            progress.status = f"loss {row['train_loss']:.4f}"
            _print_row(label, row, progress)
            window = []
            t0 = time.perf_counter()  # evaluation and logging are not timed
            timed_steps = 0
    progress.close()
    print(f"{label}: wrote {csv_path}", flush=True)
    if on_done is not None:
        on_done(state)
    return records


def _row(step, losses, step_s, elapsed, loss, args, flops_per_token) -> dict:
    tokens = args.batch * args.seq_len
    devices = _device_count(loss)
    return {
        "step": step,
        "loss": float(losses[-1]),
        "train_loss": float(losses.mean()),
        "eval_loss": "",
        "lr": "",
        "step_ms": step_s * 1e3,
        "tflops_per_device": flops_per_token * tokens / step_s / devices / 1e12,
        "tokens_per_s_per_device": tokens / step_s / devices,
        "elapsed_s": elapsed,
    }


def _device_count(x: jax.Array) -> int:
    try:
        return max(1, len(x.sharding.device_set))
    except AttributeError:
        return 1


def _print_row(label: str, row: dict, progress: _Progress) -> None:
    ev = row["eval_loss"]
    text = (
        f"{label} step {row['step']:>6}  loss {row['train_loss']:.4f}"
        + (f"  held-out {ev:.4f}" if ev != "" else "")
        + f"  {row['step_ms']:8.2f} ms/step"
        f"  {row['tflops_per_device']:7.3g} TFLOP/s/device"
        f"  {row['tokens_per_s_per_device']:10.0f} tokens/s/device"
    )
    if progress.enabled:
        sys.stderr.write("\r\x1b[2K")
    print(text, flush=True)


def _stop_nonfinite(label: str, step: int, value: float, progress: _Progress):
    progress.close()
    raise FloatingPointError(
        f"{label}: the training loss is {value} at step {step}; stopping (rows so "
        "far are in the CSV). Try a lower --lr, more --warmup, or a precision "
        "with fewer layers in NVFP4 (--keep-last)."
    )


# ------------------------------------------------------------------ reports


def summarize(records: Sequence[dict], last_steps: int = 100) -> dict:
    """Final losses and speed of one run's rows.

    Returns train_loss and eval_loss averaged over the rows of the last
    ``last_steps`` steps (eval_loss over the evaluations in that range, or the
    last one), and the median step_ms, tflops_per_device and
    tokens_per_s_per_device over all timed rows.
    """
    if not records:
        raise ValueError("no records to summarize")
    final = int(records[-1]["step"])
    tail = [r for r in records if int(r["step"]) > final - last_steps]
    evals = [float(r["eval_loss"]) for r in tail if r["eval_loss"] not in ("", None)]
    if not evals:
        evals = [float(r["eval_loss"]) for r in records if r["eval_loss"] != ""][-1:]
    timed = [r for r in records if math.isfinite(float(r["step_ms"]))]

    def median(name):
        return float(np.median([float(r[name]) for r in timed])) if timed else math.nan

    return {
        "steps": final,
        "train_loss": float(np.mean([float(r["train_loss"]) for r in tail])),
        "eval_loss": float(np.mean(evals)) if evals else math.nan,
        "step_ms": median("step_ms"),
        "tflops_per_device": median("tflops_per_device"),
        "tokens_per_s_per_device": median("tokens_per_s_per_device"),
    }


def read_csv(path: str) -> list[dict]:
    """The rows of a run's CSV (values as strings, as written)."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def plot_curves(csv_paths: Sequence[str], png_path: str) -> None:
    """Draws the training and held-out loss of several runs into one PNG.

    Each CSV (written by ``run_training``) is one line, labelled by its file
    name. Needs matplotlib (``pip install matplotlib``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plot_curves needs matplotlib: pip install matplotlib") from e
    fig, (ax_train, ax_eval) = plt.subplots(1, 2, figsize=(11, 4))
    for path in csv_paths:
        rows = read_csv(path)
        label = os.path.splitext(os.path.basename(path))[0]
        steps = [int(r["step"]) for r in rows]
        ax_train.plot(steps, [float(r["train_loss"]) for r in rows], label=label)
        ev = [(int(r["step"]), float(r["eval_loss"])) for r in rows if r["eval_loss"]]
        if ev:
            ax_eval.plot(*zip(*ev, strict=True), marker=".", label=label)
    for ax, title in ((ax_train, "training loss"), (ax_eval, "held-out loss")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/byte)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(png_path) or ".", exist_ok=True)
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def _role(record: dict, stochastic_dy: bool) -> str:
    """What a measured operand is, from how the recipe quantizes it: a weight,
    dY (rounded stochastically), x; where the recipe rounds dY to nearest
    (``stochastic_dy`` False) x and dY look alike: "x|dY"."""
    if record["weight"]:
        return "w"
    if record["stochastic"]:
        return "dY"
    return "x" if stochastic_dy else "x|dY"


def worst_operands(records: Sequence[dict], count: int) -> list[dict]:
    """The ``count`` quantized operands of ``write_operand_stats``' records
    with the most underflow, each at its worst layer."""
    sites: dict[tuple, dict] = {}
    for r in records:
        key = (r["site"], r["side"])
        if key not in sites or r["underflow"] > sites[key]["underflow"]:
            sites[key] = r
    return sorted(sites.values(), key=lambda r: -r["underflow"])[:count]


def write_operand_stats(path: str, grad_fn: Callable, *args, worst: int = 5) -> None:
    """Measures every operand the recipe quantizes in ``grad_fn(*args)`` (a
    model's gradient on one batch; ``jax_nvfp4.statistics.operand_stats``),
    writes the records to ``path`` as JSON, and prints the ``worst`` sites by
    underflow (the largest over the layers of a stack)."""
    _, records = nv.statistics.operand_stats(grad_fn, *args)
    stochastic_dy = any(r["stochastic"] for r in records)
    for r in records:
        r["role"] = _role(r, stochastic_dy)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
    print(f"operand statistics ({len(records)} quantizations) written to {path}")
    header = "  role side  shape                 iteration  underflow  zero-scale"
    print(header + "  rel. error")
    for r in worst_operands(records, worst):
        print(
            f"  {r['role']:4s} {r['side']:5s} {str(r['shape']):21s} "
            f"{str(r['iteration']):10s} {r['underflow']:9.4f}  "
            f"{r['zero_scale_blocks']:10.4f}  {r['relative_error']:10.4f}"
        )
