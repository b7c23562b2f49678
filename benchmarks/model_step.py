"""The project's speed yardstick: a Llama training step, bf16 against NVFP4.

    python benchmarks/model_step.py                        # every size, timed
    python benchmarks/model_step.py --sizes d2048-8k --rounds 3
    python benchmarks/model_step.py --memory     # peak memory, a process each
    python benchmarks/model_step.py --profile --sizes d2048-8k   # kernel families
    python benchmarks/model_step.py --eval       # the loss alone (evaluation)

The models are nvfp4_examples.llama_flax's (Flax NNX; nnx.scan) and
nvfp4_examples.llama_equinox's (Equinox; lax.scan over eqx.filter_vmap-built
blocks, per-example vmap folded into the GEMMs), --frameworks picks: stacked
blocks, the last one a stack of its own ("tail"), cudnn attention on a GPU,
AdamW, fp32 master weights, bf16 compute. Sizes (--sizes, comma-separated):

    d2048-8k    d 2048, 8 blocks, 16 heads, SwiGLU 8192, 8 x 1024 tokens
    d2048-32k   the same at 32 x 1024 tokens
    d4096-8k    d 4096, 4 blocks, 32 heads, SwiGLU 14336, 8 x 1024 tokens
    tiny        d 64, 2 blocks, 2 heads, SwiGLU 128, 2 x 64 tokens (CPU smoke)

Precisions (--precisions): bf16; mlp = MLP linears of all but the last block
in NVFP4 (the tail kept in bf16 by its path); mlp+attn = attention
projections too; mlp-switch (not by default) = mlp with all blocks in one
stack, the last kept in bf16 by the per-layer switch (a lax.cond in the scan,
whose both branches' residuals are kept). --remat picks what each block keeps
for the backward pass (the examples' REMAT_POLICIES).

Timing: every configuration of a size is compiled first; then rounds in which
each configuration in turn settles (runs untimed for --settle seconds, so
that a power-limited GPU reaches that step's own clock) and is timed over
--steps steps dispatched back to back. Ratios to bf16 are taken within each
round; the table prints their median and range. --memory runs each
configuration in a process of its own and reports its peak device memory.
--profile traces two steps of each configuration with jax.profiler (then
times six more, unsettled) and sums the device kernels by family (GEMMs,
attention, NVFP4 quantize, amax, decode, XLA transposes, other fusions),
printing what NVFP4 adds to bf16's step (device kernels only: nothing on a
CPU).
"""

from __future__ import annotations

import collections
import json
import re
import statistics
import subprocess
import sys
import time

import equinox as eqx
import jax
import optax
from common import argument_parser, header, write_json  # and examples/ on sys.path
from flax import nnx
from nvfp4_examples import llama_equinox, llama_flax

import jax_nvfp4.equinox as nveqx
from jax_nvfp4.flax import convert
from jax_nvfp4.policy import Policy, transformer_policy

SIZES = {
    # name: (d_model, blocks, heads, ffn, batch, seq_len)
    "d2048-8k": (2048, 8, 16, 8192, 8, 1024),
    "d2048-32k": (2048, 8, 16, 8192, 32, 1024),
    "d4096-8k": (4096, 4, 32, 14336, 8, 1024),
    "tiny": (64, 2, 2, 128, 2, 64),
}
PRECISIONS = ("bf16", "mlp", "mlp+attn")
# Not timed by default: the MLP policy with the last block in the same stack,
# kept in bf16 by a per-layer switch (lax.cond) instead of a stack of its own.
SWITCH = "mlp-switch"
FRAMEWORKS = ("flax", "equinox")


def policy_for(precision: str, blocks: int) -> Policy | None:
    """The model's last block is a stack of its own ("tail"), kept in bf16 by
    its path; mlp-switch keeps it by the per-layer switch of one stack."""
    if precision == "bf16":
        return None
    if precision == SWITCH:
        return transformer_policy(blocks, keep_last=1)
    patterns = {"mlp": ("*mlp*",), "mlp+attn": ("*mlp*", "*attn*")}
    if precision not in patterns:
        raise ValueError(
            f"precision must be one of {PRECISIONS + (SWITCH,)}, got {precision!r}"
        )
    return transformer_policy(
        blocks,
        keep_last=0,
        nvfp4_patterns=patterns[precision],
        bf16_patterns=("tail.*", "*router*"),
    )


def build_step(
    size: str,
    precision: str,
    remat: str,
    framework: str = "flax",
    evaluate: bool = False,
):
    """(jitted step(state, tokens) -> (state, loss), state, tokens): one AdamW
    step of the example's Llama in ``framework``; with ``evaluate``, the loss
    alone (no gradients, the state returned as it came)."""
    d, blocks, heads, ffn, batch, seq = SIZES[size]
    gpu = jax.default_backend() == "gpu"
    tail = 0 if precision == SWITCH else 1
    policy = policy_for(precision, blocks)
    tokens = jax.random.randint(jax.random.key(0), (batch, seq + 1), 0, 256)
    if framework == "equinox":
        step, state = _equinox_step(size, policy, remat, tail, gpu, evaluate)
        return step, state, tokens
    model = llama_flax.Llama(
        d_model=d,
        layers=blocks,
        heads=heads,
        ffn=ffn,
        attention="cudnn" if gpu else "xla",
        remat=remat,
        tail_layers=tail,
        rngs=nnx.Rngs(params=0),
    )
    if policy is not None:
        convert(model, policy, nnx.Rngs(nvfp4=1))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def step(state, tokens):
        model, optimizer = nnx.merge(graphdef, state)
        if evaluate:
            return state, llama_flax.next_byte_loss(model, tokens)
        loss, grads = nnx.value_and_grad(llama_flax.next_byte_loss)(model, tokens)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    return jax.jit(step, donate_argnums=() if evaluate else 0), state, tokens


def _equinox_step(size, policy, remat, tail, gpu, evaluate):
    """(step, state) of nvfp4_examples.llama_equinox's model: float32 master
    weights cast to bf16 in the step, one stochastic-rounding key per step."""
    d, blocks, heads, ffn, _, _ = SIZES[size]
    model = llama_equinox.Llama(
        d_model=d,
        layers=blocks,
        heads=heads,
        ffn=ffn,
        attention="cudnn" if gpu else None,
        remat=remat,
        tail_layers=tail,
        key=jax.random.key(0),
    )
    if policy is not None:
        model = nveqx.convert(model, policy)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    tx = optax.adamw(1e-4)

    def step(state, tokens):
        params, opt_state, key = state
        key, step_key = jax.random.split(key)

        def loss_of(params):
            model = llama_equinox.to_bf16(eqx.combine(params, static))
            return llama_equinox.loss_fn(model, tokens, step_key)

        if evaluate:
            return state, loss_of(params)
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, key), loss

    state = (params, tx.init(params), jax.random.key(1))
    return jax.jit(step, donate_argnums=() if evaluate else 0), state


def run_steps(step, state, tokens, n: int):
    for _ in range(n):
        state, loss = step(state, tokens)
    jax.block_until_ready(loss)
    return state


def time_configs(
    size, precisions, remat, rounds, steps, settle, framework, evaluate=False
):
    """{precision: [ms per step, one per round]}, interleaved rounds."""
    built = {}
    for precision in precisions:
        step, state, tokens = build_step(size, precision, remat, framework, evaluate)
        state = run_steps(step, state, tokens, 2)  # compile and warm up
        built[precision] = [step, state, tokens]
    times = collections.defaultdict(list)
    for _ in range(rounds):
        for precision in precisions:
            step, state, tokens = built[precision]
            start = time.perf_counter()
            while time.perf_counter() - start < settle:
                state = run_steps(step, state, tokens, 1)
            start = time.perf_counter()
            state = run_steps(step, state, tokens, steps)
            times[precision].append((time.perf_counter() - start) / steps * 1e3)
            built[precision][1] = state
    return dict(times)


def peak_memory(size, precision, remat, framework, evaluate=False) -> float | None:
    """Peak device memory (GiB) of a few steps of one configuration."""
    step, state, tokens = build_step(size, precision, remat, framework, evaluate)
    run_steps(step, state, tokens, 3)
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30


# Kernel families of a traced step, matched on the kernel's name in order.
FAMILIES = (
    ("nvfp4 quantize", r"Quantize(Tile|PrivateTile|Rows)Kernel"),
    ("nvfp4 amax", r"Amax(Columns\w*)?Kernel"),
    ("nvfp4 decode", r"(DecodeBf16|Dequantize)Kernel"),
    ("nvfp4 alpha", r"AlphaKernel"),
    ("attention", r"cudnn|flash|fmha|sdpa|attention"),
    ("GEMM", r"gemm|Gemm|GEMM|nvjet|xmma|cutlass|sm90_"),
    ("XLA transpose", r"transpose"),
    ("XLA reduce", r"reduce"),
    ("copy / memset", r"copy|memset|memcpy|Memset|Memcpy"),
)


def family(name: str) -> str:
    for label, pattern in FAMILIES:
        if re.search(pattern, name):
            return label
    return "other fusions"


class _TwoSteps:
    """Two steps per call, the state carried between calls (it is donated)."""

    def __init__(self, step, state):
        self.step, self.state = step, state

    def __call__(self, tokens):
        for _ in range(2):
            self.state, loss = self.step(self.state, tokens)
        return loss


def profile(size, precisions, remat, framework, evaluate=False):
    """{precision: {family: µs per step}} of two traced steps each."""
    from step_profile import trace_events

    result = {}
    for precision in precisions:
        step, state, tokens = build_step(size, precision, remat, framework, evaluate)
        state = run_steps(step, state, tokens, 2)
        two_steps = _TwoSteps(step, state)
        lines = trace_events(two_steps, tokens, warmup=1)
        start = time.perf_counter()
        jax.block_until_ready([two_steps(tokens) for _ in range(3)])
        wall_ms = (time.perf_counter() - start) / 6 * 1e3
        families = collections.defaultdict(float)
        names = collections.defaultdict(float)
        for line, events in lines.items():
            if "XLA Ops" in line or "Modules" in line or "Steps" in line:
                continue  # XLA's own op lines repeat the stream's kernels
            for name, ns, _ in events:
                families[family(name)] += ns / 1e3 / 2  # per step
                names[name] += ns / 1e3 / 2
        result[precision] = {
            "families": dict(families),
            "top": dict(names),
            "wall_ms": wall_ms,
        }
    return result


def main(argv=None):
    parser = argument_parser(__doc__)
    parser.add_argument("--sizes", default="d2048-8k,d2048-32k,d4096-8k")
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--remat", default="none", choices=llama_flax.REMAT_POLICIES)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps a round")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds")
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--eval", action="store_true", help="the loss alone: an evaluation step"
    )
    parser.add_argument("--only", help=argparse_hidden())
    parser.add_argument("--out", help="write every sample as JSON here")
    args = parser.parse_args(argv)
    sizes = args.sizes.split(",")
    frameworks = args.frameworks.split(",")
    precisions = args.precisions.split(",")
    if precisions[0] != "bf16":
        raise SystemExit("--precisions must start with bf16 (the baseline)")
    for precision in precisions:
        if precision not in PRECISIONS + (SWITCH,):
            raise SystemExit(
                f"unknown precision {precision!r}; choose from {PRECISIONS + (SWITCH,)}"
            )
    for size in sizes:
        if size not in SIZES:
            raise SystemExit(f"unknown size {size!r}; choose from {sorted(SIZES)}")
    for framework in frameworks:
        if framework not in FRAMEWORKS:
            raise SystemExit(f"unknown framework {framework!r}; choose {FRAMEWORKS}")

    if args.only:  # a child of --memory: one configuration, one line of JSON
        framework, size, precision = args.only.split(":")
        peak = peak_memory(size, precision, args.remat, framework, args.eval)
        print(json.dumps({"peak_gib": peak}))
        return

    print(header())
    step_kind = "evaluation step (the loss alone)" if args.eval else "training step"
    print(f"remat={args.remat} | {step_kind}")
    payload = {"remat": args.remat, "eval": args.eval, "runs": {}}
    for size in sizes:
        for framework in frameworks:
            d, blocks, heads, ffn, batch, seq = SIZES[size]
            print(
                f"\n{framework} {size}: d {d}, {blocks} blocks, {heads} heads, "
                f"SwiGLU {ffn}, {batch} x {seq} tokens"
            )
            record = payload["runs"][f"{framework}:{size}"] = {}
            if args.memory:
                record["peak_gib"] = _memory(args, framework, size, precisions)
            elif args.profile:
                record["profile"] = _profile(args, framework, size, precisions)
            else:
                record["ms_per_step"] = _timed(args, framework, size, precisions)
    if args.out:
        write_json(args.out, payload)


def _memory(args, framework, size, precisions):
    """Peak memory of each precision, each in a process of its own."""
    peaks = {}
    for precision in precisions:
        child = subprocess.run(
            [sys.executable, __file__, "--only", f"{framework}:{size}:{precision}"]
            + ["--remat", args.remat]
            + (["--eval"] if args.eval else []),
            capture_output=True,
            text=True,
            check=False,
        )
        lines = child.stdout.strip().splitlines()
        peak = json.loads(lines[-1])["peak_gib"] if lines else None
        peaks[precision] = peak
        base = peaks["bf16"]
        ratio = f"{peak / base:.2f}x bf16" if peak and base else ""
        shown = "n/a" if peak is None else f"{peak:.2f} GiB"
        print(f"  peak memory {precision:10s} {shown} {ratio}")
        if child.returncode:
            print(child.stderr[-2000:], file=sys.stderr)
    return peaks


def _profile(args, framework, size, precisions):
    result = profile(size, precisions, args.remat, framework, args.eval)
    last = precisions[-1]
    families = sorted(
        {f for r in result.values() for f in r["families"]},
        key=lambda f: -result[last]["families"].get(f, 0),
    )
    print(f"  {'µs per step':24s}" + "".join(f"{p:>12s}" for p in precisions))
    for f in families + ["busy"]:
        values = [
            sum(result[p]["families"].values())
            if f == "busy"
            else result[p]["families"].get(f, 0.0)
            for p in precisions
        ]
        print(f"  {f:24s}" + "".join(f"{v:12,.0f}" for v in values))
    base = sum(result["bf16"]["families"].values())
    for p in precisions[1:]:
        busy = sum(result[p]["families"].values())
        wall = result[p]["wall_ms"] / result["bf16"]["wall_ms"]
        busy_ratio = f"{busy / base:.3f}x" if base else "n/a"
        print(
            f"  {p}: busy time {busy_ratio} bf16; wall clock of 6 "
            f"unsettled steps {result[p]['wall_ms']:.2f} ms, {wall:.3f}x bf16"
        )
    # What the last precision adds to bf16's step, kernel by kernel.
    added = {
        name: us - result["bf16"]["top"].get(name, 0.0)
        for name, us in result[last]["top"].items()
    }
    print(f"  kernels {last} adds to bf16's (µs per step):")
    for name, us in sorted(added.items(), key=lambda kv: -kv[1])[:15]:
        print(f"    {us:10,.0f}  {name[:90]}")
    return result


def _timed(args, framework, size, precisions):
    times = time_configs(
        size,
        precisions,
        args.remat,
        args.rounds,
        args.steps,
        args.settle,
        framework,
        args.eval,
    )
    for precision in precisions:
        ratios = [t / b for t, b in zip(times[precision], times["bf16"], strict=True)]
        print(
            f"  {precision:10s} {statistics.median(times[precision]):9.2f} "
            f"ms/step  {statistics.median(ratios):.3f}x bf16 "
            f"({min(ratios):.3f}..{max(ratios):.3f})"
        )
    return times


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
