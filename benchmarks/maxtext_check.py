"""MaxText's own decoder trained in NVFP4 through ``use_qwix_quantization``.

    python benchmarks/maxtext_check.py --out /tmp/maxtext_check.json
    python benchmarks/maxtext_check.py --dry            # tiny sizes, 3 steps

Needs MaxText 0.2.5 (Python >= 3.12) and what its model code imports; the
summary names whatever could not be imported. Builds MaxText's
``Transformer`` (the NNX model its trainer builds: ``pyconfig.initialize``
on its ``base.yml``, then ``model_creation_utils.create_model``) twice per
decoder: in bf16, and with ``use_qwix_quantization=true quantization=fp4``
while MaxText's ``quantizations.get_qt_provider`` returns
``jax_nvfp4.qwix.NvFp4Provider`` (the patch examples/maxtext_nvfp4.py
describes). ``create_model`` then quantizes the model itself, by
``quantizations.maybe_quantize_model`` (``qwix.quantize_model`` on dummy
tokens). Both models train on the same synthetic batches with MaxText's own
loss (``maxtext.trainers.pre_train.train.loss_fn``) and a hand-written
``nnx.Optimizer`` (optax adam) step under ``nnx.jit``; MaxText's
``train.main`` also sets up checkpointing, metrics and a data pipeline that
this check has no use for.

Decoders: ``llama2`` (dense) and ``mixtral`` (MoE: ``--experts`` experts,
``sparse_matmul=true megablox=false``, so the experts run
``jax.lax.ragged_dot``, which the provider intercepts; the router
``.../gate`` stays bf16). The batches are ``--patterns`` fixed random token
sequences, drawn with replacement each step: memorizable, so the loss falls
in a few steps. The check fails (exit 1) unless, per decoder, the NVFP4 run
traced products through jax_nvfp4 and the bf16 run none, both losses fall by
``--min-drop`` (first step to the mean of the last 3) and NVFP4's final loss
is within ``--rel-tol`` of bf16's. Products that should be NVFP4 but were
traced in bf16 are listed under "partial".

MaxText's MoE runs its experts inside ``jax.shard_map``, and two things of
the provider meet it there. The NNX stream's counter cannot advance inside
it (flax ``TraceContextError``), so the experts' rule uses
``jax_nvfp4.NVFP4_NO_SR`` (``--moe-expert-sr`` tries the full recipe). And
qwix cannot trace the weights there back to the module's params: it falls
back to matching shapes, which finds ``wo`` but not ``wi_0``/``wi_1`` (two
params of one shape), so those two stay bf16 ("partial").

``scan_layers`` is off by default here (MaxText's default is on): under
MaxText's layer scan the products draw their keys from a copy of the
stream whose counter is not carried out of the scan, so every step and
every layer would round with the same keys; with ``--scan-layers`` the
summary reports that ("SR keys per step" 0).

One stub, and only when its package is missing: ``tokamax`` (imported by
MaxText's MoE and attention layers) imports ``xprof.cli.tools`` at the top
of its benchmarking module, for its xprof timing method; ``xprof`` is a
32 MB profiler wheel that pulls in google-cloud-storage and duckdb, and
nothing here profiles. Without ``xprof``, empty modules stand in for
``xprof``, ``xprof.cli``, ``xprof.cli.tools`` and
``xprof.cli.tools.get_kernel_stats_tool``; the summary records it. MaxText's
own no-op stand-ins for its Google Cloud telemetry (goodput, mldiagnostics,
workload monitor, vertex tensorboard) print ``[NO-OP]`` lines at import.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback

from common import stub_xprof

# What MaxText's model code imports beyond jax/flax/optax/orbax (the
# distribution names, for the error message).
_NEEDED = {
    "maxtext": "maxtext",
    "qwix": "qwix",
    "omegaconf": "omegaconf (and antlr4-python3-runtime)",
    "pydantic": "pydantic (and pydantic-core, annotated-types, typing-inspection)",
    "aqt": "aqtp",
    "tokamax": "tokamax (and immutabledict, einshape, tensorboardx)",
    "grain": "grain (and array-record, portpicker, cloudpickle)",
    "drjax": "drjax",
    "pathwaysutils": (
        "pathwaysutils (and fastapi, starlette, uvicorn, opentelemetry-api)"
    ),
}
_DISTS = (
    "jax jaxlib flax optax orbax-checkpoint qwix maxtext tokamax aqtp grain "
    "pydantic omegaconf numpy jax_nvfp4"
).split()


_HEADER = (
    "python",
    "versions",
    "devices",
    "jax_nvfp4_platforms",
    "jax_nvfp4_path",
    "stubbed",
)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "missing"


def _preflight(summary: dict) -> None:
    """Imports what the check needs; raises naming everything that failed."""
    summary["python"] = platform.python_version()
    summary["versions"] = {d: _version(d) for d in _DISTS}
    summary["stubbed"] = []
    if sys.version_info < (3, 12):
        raise RuntimeError(
            f"MaxText 0.2.5 needs Python >= 3.12; this is {platform.python_version()}"
        )
    if stub_xprof():
        summary["stubbed"].append(
            "xprof, xprof.cli, xprof.cli.tools, xprof.cli.tools.get_kernel_stats_tool"
            " (tokamax's benchmarking module imports them; unused here)"
        )
    failed = []
    for module, dist in _NEEDED.items():
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - report every missing piece at once
            failed.append(f"{module} (wheel: {dist}): {type(e).__name__}: {e}")
    for module in (
        "maxtext.configs.pyconfig",
        "maxtext.layers.quantizations",
        "maxtext.models.models",
        "maxtext.utils.model_creation_utils",
        "maxtext.utils.maxtext_utils",
        "maxtext.trainers.pre_train.train",
        "jax_nvfp4.qwix",
    ):
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001
            failed.append(
                f"{module}: {type(e).__name__}: {e}\n"
                + "".join(traceback.format_exception(e)[-4:])
            )
    if failed:
        summary["import_failures"] = failed
        raise ImportError(
            "MaxText's model code could not be imported:\n  " + "\n  ".join(failed)
        )
    import jax

    import jax_nvfp4

    summary["devices"] = [str(d) for d in jax.devices()]
    summary["jax_nvfp4_platforms"] = sorted(jax_nvfp4.available_platforms())
    summary["jax_nvfp4_path"] = os.path.dirname(jax_nvfp4.__file__)
    if jax.default_backend() == "gpu" and "cuda" not in summary["jax_nvfp4_platforms"]:
        # The runs would time the pure-JAX twin, not the CUDA handlers.
        raise RuntimeError(
            f"jax_nvfp4 at {summary['jax_nvfp4_path']} has no CUDA handlers "
            f"(available_platforms: {summary['jax_nvfp4_platforms']}): install "
            "it (pip install --no-build-isolation --no-deps .) and run this "
            "script from a directory where the source tree does not shadow it"
        )


def _overrides(args, decoder: str, nvfp4: bool) -> dict:
    """MaxText config keys (base.yml names) of one run."""
    import jax

    platform_ = jax.devices()[0].platform
    cfg = dict(
        run_name=f"maxtext_check_{decoder}_{'nvfp4' if nvfp4 else 'bf16'}",
        base_output_directory=args.workdir,
        hardware="gpu" if platform_ == "gpu" else "cpu",
        skip_jax_distributed_system=True,
        enable_checkpointing=False,
        dataset_type="synthetic",
        decoder_block=decoder,
        base_emb_dim=args.emb,
        base_num_query_heads=args.heads,
        base_num_kv_heads=args.heads,
        head_dim=args.emb // args.heads,
        base_mlp_dim=args.mlp,
        base_num_decoder_layers=args.layers,
        vocab_size=args.vocab,
        max_target_length=args.seq,
        per_device_batch_size=args.batch / jax.device_count(),
        dtype="bfloat16",
        weight_dtype="float32",
        attention="dot_product",
        scan_layers=args.scan_layers,
        enable_dropout=False,
        dropout_rate=0.0,
        init_weights_seed=0,
        learning_rate=args.lr,
        log_config=False,
    )
    if decoder == "mixtral":
        cfg.update(
            base_moe_mlp_dim=args.mlp,
            num_experts=args.experts,
            num_experts_per_tok=args.topk,
            sparse_matmul=True,
            megablox=False,
            use_tokamax_gmm=False,
            capacity_factor=-1.0,
            quantize_router_proj=False,
        )
    if nvfp4:
        cfg.update(use_qwix_quantization=True, quantization="fp4")
    return cfg


def _provider(args):
    """What the patched ``quantizations.get_qt_provider`` returns."""
    import qwix

    from jax_nvfp4 import NVFP4, NVFP4_NO_SR
    from jax_nvfp4.qwix import NvFp4Provider, NvFp4Rule

    return NvFp4Provider(
        [
            # The MoE router (N = num_experts): bf16, as MaxText keeps it.
            qwix.QtRule(module_path=r".*/gate$"),
            # The experts' ragged_dots run inside MaxText's shard_map, where
            # the NNX stream's counter cannot advance (TraceContextError): no
            # stochastic rounding of dY there unless --moe-expert-sr.
            NvFp4Rule(
                module_path=r"decoder/.*MoeBlock_\d+",
                recipe=NVFP4 if args.moe_expert_sr else NVFP4_NO_SR,
            ),
            # MaxText's own path for the decoder layers (get_quantization_rule).
            NvFp4Rule(module_path=r"decoder/.*layers.*"),
        ]
    )


def _context(config, mesh):
    """The mesh and logical axis rules MaxText's trainer runs under."""
    import contextlib

    import jax
    from flax.core.spmd import logical_axis_rules

    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(mesh))
    stack.enter_context(logical_axis_rules(config.logical_axis_rules))
    return stack


def _build(args, decoder: str, nvfp4: bool):
    """MaxText's config, mesh and (quantized) model, as its trainer builds them."""
    from flax import nnx
    from maxtext.configs import pyconfig
    from maxtext.layers import quantizations
    from maxtext.utils import maxtext_utils, maxtext_utils_nnx, model_creation_utils
    from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR

    from jax_nvfp4.qwix import set_rngs

    base = os.path.join(MAXTEXT_CONFIGS_DIR, "base.yml")
    config = pyconfig.initialize(
        ["maxtext_check", base], **_overrides(args, decoder, nvfp4)
    )
    mesh = maxtext_utils.get_mesh_from_config(config)
    rngs = maxtext_utils_nnx.create_nnx_rngs(config)
    original = quantizations.get_qt_provider
    quantizations.get_qt_provider = lambda config: _provider(args)
    try:
        with _context(config, mesh):
            model = model_creation_utils.create_model(config, mesh, rngs=rngs)
    finally:
        quantizations.get_qt_provider = original
    if nvfp4:
        # maybe_quantize_model deletes every qwix_rngs; the recipe's
        # stochastic rounding of dY needs a stream for the backward pass.
        model = set_rngs(model, nnx.Rngs(nvfp4=config.init_weights_seed + 1))
    return config, mesh, model


def _batches(args):
    """Steps x MaxText batch dicts from --patterns fixed random sequences."""
    import numpy as np

    rng = np.random.default_rng(0)
    pool = rng.integers(0, args.vocab, (args.patterns, args.seq + 1), dtype=np.int32)
    out = []
    positions = np.broadcast_to(
        np.arange(args.seq, dtype=np.int32), (args.batch, args.seq)
    )
    ones = np.ones((args.batch, args.seq), np.int32)
    for _ in range(args.steps):
        seq = pool[rng.integers(0, args.patterns, args.batch)]
        out.append(
            dict(
                inputs=seq[:, :-1],
                inputs_position=positions,
                inputs_segmentation=ones,
                targets=seq[:, 1:],
                targets_position=positions,
                targets_segmentation=ones,
            )
        )
    return out


def _sr_draws(model) -> int:
    """How many stochastic-rounding keys the model's NVFP4 stream has drawn
    (the shared stream's counter; set_rngs puts one stream on every module)."""
    import jax
    from flax import nnx

    counts = [
        int(value)
        for path, value in jax.tree_util.tree_leaves_with_path(
            nnx.state(model, nnx.RngCount)
        )
        if "qwix_rngs" in jax.tree_util.keystr(path)
    ]
    return max(counts, default=0)


class _CountNvFp4:
    """Counts the products the provider hands to jax_nvfp4 while a step is
    traced (a scanned layer body is traced once, so these are call sites)."""

    def __enter__(self):
        from jax_nvfp4 import qwix as module

        self.counts = {"dot_general": 0, "ragged_dot": 0}
        self._saved = []
        # The provider's entry points into jax_nvfp4, by the product counted.
        for name, counted in (("product_general", "dot_general"), ("ragged_dot",) * 2):
            fn = getattr(module, name)
            self._saved.append((module, name, fn))
            setattr(module, name, self._counting(fn, counted))
        return self

    def _counting(self, fn, name):
        def wrapper(*args, **kwargs):
            self.counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    def __exit__(self, *exc):
        for module, name, fn in self._saved:
            setattr(module, name, fn)


def _train(args, decoder: str, nvfp4: bool, batches) -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec
    from maxtext.trainers.pre_train import train as mt_train

    name = f"{decoder}/{'nvfp4' if nvfp4 else 'bf16'}"
    t0 = time.perf_counter()
    config, mesh, model = _build(args, decoder, nvfp4)
    build_s = time.perf_counter() - t0
    params = nnx.state(model, nnx.Param)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    optimizer = nnx.Optimizer(model, optax.adam(args.lr), wrt=nnx.Param)
    # Arrays made outside the mesh (RNG keys, counters) come back from the
    # step on it; placing them there first keeps the step from compiling twice.
    replicated = NamedSharding(mesh, PartitionSpec())

    def place(x):
        if isinstance(x, jax.Array) and not isinstance(x.sharding, NamedSharding):
            return jax.device_put(x, replicated)
        return x

    nnx.update((model, optimizer), jax.tree.map(place, nnx.state((model, optimizer))))

    @nnx.jit
    def step(model, optimizer, data):
        def loss_fn(model):
            loss, aux = mt_train.loss_fn(model, config, data, None, None, is_train=True)
            return loss, aux

        (loss, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        return loss

    losses, times = [], []
    draws = _sr_draws(model)
    with _context(config, mesh):
        for data in batches:
            data = {k: jnp.asarray(v) for k, v in data.items()}
            t = time.perf_counter()
            if not losses:  # the first call traces the step
                with _CountNvFp4() as counter:
                    loss = float(step(model, optimizer, data))
            else:
                loss = float(step(model, optimizer, data))
            times.append(time.perf_counter() - t)
            losses.append(loss)
            print(
                f"  {name} step {len(losses) - 1:3d}  loss {loss:.4f}  "
                f"{times[-1] * 1e3:8.1f} ms",
                flush=True,
            )
    steady = times[1:] or times
    draws = _sr_draws(model) - draws
    return dict(
        decoder=decoder,
        nvfp4=nvfp4,
        params=int(n_params),
        nvfp4_call_sites=counter.counts,
        sr_keys_per_step=draws / len(losses),
        build_s=round(build_s, 2),
        first_step_s=round(times[0], 2),
        step_ms_median=round(statistics.median(steady) * 1e3, 2),
        losses=[round(x, 5) for x in losses],
    )


# Projections per decoder layer that the provider should run in NVFP4: q, k,
# v, out and the MLP's wi_0, wi_1, wo; in the MoE layer the MLP's three are
# the experts' ragged_dots (the router stays bf16).
_EXPECTED = {
    "llama2": {"dot_general": 7, "ragged_dot": 0},
    "mixtral": {"dot_general": 4, "ragged_dot": 3},
}


def _label(run: dict) -> str:
    return f"{run['decoder']}/{'nvfp4' if run['nvfp4'] else 'bf16'}"


def _partial(args, nvfp4: dict) -> list[str]:
    """What of a decoder's projections did not reach jax_nvfp4."""
    per_layer = _EXPECTED.get(nvfp4["decoder"])
    if per_layer is None:
        return []
    bodies = 1 if args.scan_layers else args.layers  # a scanned body traces once
    want = {k: v * bodies for k, v in per_layer.items()}
    got = nvfp4["nvfp4_call_sites"]
    notes = []
    if got != want:
        notes.append(
            f"{_label(nvfp4)}: {got} products traced through jax_nvfp4, {want} "
            "expected; the others ran in bf16"
        )
    if sum(got.values()) and not nvfp4["sr_keys_per_step"]:
        notes.append(
            f"{_label(nvfp4)}: the NVFP4 stream drew no keys during training: "
            "stochastic rounding used the same keys every step"
        )
    return notes


def _final(run: dict) -> float:
    """The mean of the last (up to) 3 losses: one batch of a few patterns is
    a noisy estimate."""
    tail = run["losses"][-3:]
    return sum(tail) / len(tail)


def _judge(args, bf16: dict, nvfp4: dict) -> list[str]:
    """Failures of one decoder's pair of runs (empty: passed)."""
    failures = []
    for run, want in ((bf16, False), (nvfp4, True)):
        sites = run["nvfp4_call_sites"]
        if bool(sum(sites.values())) != want:
            failures.append(f"{_label(run)}: products traced through jax_nvfp4 {sites}")
    for run in (bf16, nvfp4):
        first, last = run["losses"][0], _final(run)
        if not all(math.isfinite(x) for x in run["losses"]):
            failures.append(f"{_label(run)}: non-finite loss")
        elif last > first - args.min_drop:
            failures.append(
                f"{_label(run)}: loss fell {first - last:.3f} "
                f"({first:.3f} -> {last:.3f}), less than {args.min_drop}"
            )
    a, b = _final(bf16), _final(nvfp4)
    if math.isfinite(a) and math.isfinite(b) and abs(b - a) > args.rel_tol * abs(a):
        failures.append(
            f"{bf16['decoder']}: final loss nvfp4 {b:.4f} vs bf16 {a:.4f}, "
            f"more than {args.rel_tol:.0%} apart"
        )
    return failures


def _markdown(summary: dict) -> str:
    lines = [
        "# MaxText NVFP4 check",
        "",
        f"python {summary.get('python')}, devices {summary.get('devices')}, "
        f"jax_nvfp4 platforms {summary.get('jax_nvfp4_platforms')}",
        "",
        "| package | version |",
        "| --- | --- |",
    ]
    lines += [f"| {k} | {v} |" for k, v in summary.get("versions", {}).items()]
    if summary.get("stubbed"):
        lines += ["", "Stubbed: " + "; ".join(summary["stubbed"])]
    lines += [
        "",
        "| run | params | jax_nvfp4 call sites | SR keys per step | build s "
        "| first step s | step ms (median) | loss first | loss last 3 (mean) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in summary.get("runs", []):
        lines.append(
            f"| {_label(r)} | {r['params']:,} | {r['nvfp4_call_sites']} | "
            f"{r['sr_keys_per_step']:g} | "
            f"{r['build_s']} | {r['first_step_s']} | {r['step_ms_median']} | "
            f"{r['losses'][0]:.4f} | {_final(r):.4f} |"
        )
    for key in ("errors", "skipped", "failures", "partial"):
        if summary.get(key):
            lines += ["", f"## {key}", ""] + [f"- {e}" for e in summary[key]]
    lines += [
        "",
        f"**{'PASS' if summary.get('passed') else 'FAIL'}** "
        f"({summary.get('wall_s')} s)",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="summary JSON path (a .md beside it)")
    parser.add_argument("--dry", action="store_true", help="tiny sizes, 3 steps")
    parser.add_argument("--decoders", default="llama2,mixtral")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--emb", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--mlp", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--patterns", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--scan-layers",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="MaxText's scan_layers (its default is on; off here: under "
        "MaxText's scan the NVFP4 stream's counter does not advance)",
    )
    parser.add_argument("--min-drop", type=float, default=1.0)
    parser.add_argument("--rel-tol", type=float, default=0.1)
    parser.add_argument("--workdir", default="/tmp/maxtext_check")
    parser.add_argument("--modes", default="bf16,nvfp4", help="bf16 and/or nvfp4")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=0,
        help="skip a run that would likely end past this many seconds (0: none)",
    )
    parser.add_argument(
        "--moe-expert-sr",
        action="store_true",
        help="stochastic rounding in the MoE experts too (fails; see _provider)",
    )
    args = parser.parse_args(argv)
    if args.dry:  # tiny defaults; explicit flags still win
        parser.set_defaults(
            steps=3,
            emb=64,
            heads=4,
            mlp=128,
            layers=2,
            vocab=512,
            seq=64,
            batch=4,
            min_drop=-math.inf,  # too few steps to ask for a fall
        )
        args = parser.parse_args(argv)

    start = time.perf_counter()
    summary: dict = {
        "args": vars(args),
        "runs": [],
        "errors": [],
        "skipped": [],
        "failures": [],
        "partial": [],
    }

    def write():
        summary["passed"] = bool(summary["runs"]) and not any(
            summary[k] for k in ("errors", "skipped", "failures")
        )
        summary["wall_s"] = round(time.perf_counter() - start, 1)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(summary, f, indent=1)
            with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
                f.write(_markdown(summary))

    try:
        _preflight(summary)
        print(json.dumps({k: summary[k] for k in _HEADER}, indent=1), flush=True)
        batches = _batches(args)
        for decoder in args.decoders.split(","):
            pair = {}
            for mode in args.modes.split(","):
                label = f"{decoder}/{mode}"
                spent = time.perf_counter() - start
                # A run costs about what the slowest one so far did.
                need = max([r["wall_s"] for r in summary["runs"]] or [0])
                if args.budget_s and spent + need > args.budget_s:
                    summary["skipped"].append(
                        f"{label}: {spent:.0f} s spent, a run took up to {need:.0f} s, "
                        f"budget {args.budget_s:.0f} s"
                    )
                    print(f"== {label}: skipped (time budget)", flush=True)
                    continue
                print(f"== {label}", flush=True)
                t = time.perf_counter()
                try:
                    run = _train(args, decoder, mode == "nvfp4", batches)
                    run["wall_s"] = round(time.perf_counter() - t, 1)
                    pair[mode] = run
                    summary["runs"].append(run)
                except Exception as e:  # noqa: BLE001 - keep going, report all
                    tb = traceback.format_exc()
                    print(tb, file=sys.stderr, flush=True)
                    summary["errors"].append(
                        f"{label}: {type(e).__name__}: {e}\n{tb[-3000:]}"
                    )
                write()
            if len(pair) == 2:
                summary["failures"] += _judge(args, pair["bf16"], pair["nvfp4"])
            if "nvfp4" in pair:
                summary["partial"] += _partial(args, pair["nvfp4"])
    except Exception as e:  # noqa: BLE001
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        summary["errors"].append(f"{type(e).__name__}: {e}\n{tb[-3000:]}")
    write()
    print(_markdown(summary), flush=True)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
