"""The HBM bytes of a compiled XLA:GPU program, kernel by kernel, from its
HLO text: what each top-level op (a fusion, a custom call, a copy) reads
and writes, with the loops' bodies counted once per trip.

Not a script: ``compiled_step.py`` uses it. A kernel's bytes are its
operands' and results' sizes, with two corrections that matter in a scanned
model: an operand that the fused computation only slices (a layer's weights
out of the stacked ones) counts the slices, and a result that is a
dynamic-update-slice of an operand (a layer's residuals into the stack)
counts the update. It is a count of what each kernel must move, not a
measurement: caches, a GEMM's re-reads of its tiles and kernels that read an
operand twice are not in it.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

_DTYPE_BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "s2": 0.25,
    "u2": 0.25,
    "f8e4m3fn": 1,
    "f8e4m3": 1,
    "f8e4m3fnuz": 1,
    "f8e4m3b11fnuz": 1,
    "f8e5m2": 1,
    "f8e5m2fnuz": 1,
    "f8e3m4": 1,
    "f8e8m0fnu": 1,
    "f4e2m1fn": 0.5,
    "bf16": 2,
    "f16": 2,
    "s16": 2,
    "u16": 2,
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "f64": 8,
    "s64": 8,
    "u64": 8,
    "c64": 8,
    "c128": 16,
    "token": 0,
}
_ARRAY = re.compile(r"\b([a-z0-9]+)\[([0-9,<=]*)\]")  # "<=8": a bounded dim
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%(\S+) = (.+?) ([a-z][a-z0-9-]*)\((.*?)\)(.*)$")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) ")
# Ops that move no data of their own.
_FREE = {
    "parameter",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "constant",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
    "add-dependency",
}


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape (a tuple's elements summed)."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in _DTYPE_BYTES:
            raise ValueError(f"unknown HLO element type {dtype!r}: add its size")
        sizes = (int(d.lstrip("<=")) for d in dims.split(",") if d)
        total += _DTYPE_BYTES[dtype] * math.prod(sizes)
    return total


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str
    op: str
    operands: list[str]
    attributes: str
    number: int | None = None  # a parameter's
    root: bool = False


@dataclasses.dataclass
class Kernel:
    """One top-level op: what it is and the bytes it moves."""

    name: str
    op: str
    target: str  # a custom call's target, a fusion's kind, else the op
    shape: str
    bytes: float
    trips: int


def parse(text: str) -> dict[str, list[Instruction]]:
    """{computation name: its instructions}; the entry is also "ENTRY"."""
    computations: dict[str, list[Instruction]] = {}
    current = None
    for line in text.splitlines():
        if not line.startswith(" ") and "{" in line and "->" in line:
            match = _COMPUTATION.match(line)
            current = match.group(1) if match else None
            computations[current] = []
            if line.startswith("ENTRY"):
                computations["ENTRY"] = computations[current]
            continue
        match = _INSTRUCTION.match(line)
        if current is None or match is None:
            continue
        root, name, shape, op, operands, attributes = match.groups()
        names = re.findall(r"%([\w.\-]+)", operands)
        number = int(operands) if op == "parameter" and operands.isdigit() else None
        computations[current].append(
            Instruction(name, shape, op, names, attributes, number, bool(root))
        )
    return computations


def _called(instruction: Instruction, key: str) -> str | None:
    match = re.search(key + r"=%([\w.\-]+)", instruction.attributes)
    return match.group(1) if match else None


def _fused_bytes(fusion: Instruction, shapes: dict, computations) -> float:
    """A fusion's operands and results, sliced operands and in-place
    updates counted by what they touch."""
    body = computations.get(_called(fusion, "calls") or "", [])
    if not body:
        return shape_bytes(fusion.shape) + sum(
            shape_bytes(shapes.get(o, "")) for o in fusion.operands
        )
    by_name = {ins.name: ins for ins in body}
    users = collections.defaultdict(list)
    for ins in body:
        for operand in ins.operands:
            users[operand].append(ins)

    def source(name):  # through bitcasts, to what is stored
        while name in by_name and by_name[name].op == "bitcast":
            name = by_name[name].operands[0]
        return name

    root = next((ins for ins in body if ins.root), body[-1])
    outputs = [by_name[o] for o in root.operands] if root.op == "tuple" else [root]
    total, updated = 0.0, set()
    for out in outputs:
        if out.op == "dynamic-update-slice":
            updated.add(source(out.operands[0]))
            total += shape_bytes(by_name[out.operands[1]].shape)
        else:
            total += shape_bytes(out.shape)
    params = {ins.number: ins for ins in body if ins.op == "parameter"}
    for position, operand in enumerate(fusion.operands):
        full = shape_bytes(shapes.get(operand, ""))
        param = params.get(position)
        if param is None:
            total += full
        elif param.name not in updated:
            uses = users.get(param.name, [])
            sliced = uses and all(
                u.op in ("dynamic-slice", "slice") and u.operands[0] == param.name
                for u in uses
            )  # (an index into a slice is read whole: a scalar)
            total += sum(shape_bytes(u.shape) for u in uses) if sliced else full
    return total


def _result_bytes(ins: Instruction) -> float:
    """What an op writes. A custom call's last result that is a 1-D byte
    array is a GEMM's scratch workspace (cuBLAS's, cuBLASLt's), not traffic."""
    arrays = _ARRAY.findall(ins.shape)
    if ins.op == "custom-call" and len(arrays) > 1:
        dtype, dims = arrays[-1]
        if dtype in ("u8", "s8") and "," not in dims:
            arrays = arrays[:-1]
    return sum(shape_bytes(f"{dtype}[{dims}]") for dtype, dims in arrays)


def kernels(text: str) -> list[Kernel]:
    """Every top-level op of the entry computation and of the loops it runs
    (their trip counts multiplied through), with its bytes."""
    computations = parse(text)
    out: list[Kernel] = []

    def walk(name: str, trips: int):
        body = computations.get(name, [])
        shapes = {ins.name: ins.shape for ins in body}
        for ins in body:
            if ins.op in _FREE:
                continue
            if ins.op == "while":
                count = _TRIPS.search(ins.attributes)
                each = int(count.group(1)) if count else 1
                walk(_called(ins, "body"), trips * each)
                continue
            if ins.op in ("call", "conditional", "async-start"):
                # Every branch of a conditional is counted: an upper bound.
                for callee in re.findall(r"%([\w.\-]+)", ins.attributes):
                    if callee in computations and callee != name:
                        walk(callee, trips)
                continue
            if ins.op.endswith("-done") or ins.op.endswith("-update"):
                continue  # counted at its start
            if ins.op == "fusion":
                moved = _fused_bytes(ins, shapes, computations)
                kind = re.search(r"kind=(\w+)", ins.attributes)
                target = kind.group(1) if kind else "fusion"
            else:
                moved = _result_bytes(ins) + sum(
                    shape_bytes(shapes.get(o, "")) for o in ins.operands
                )
                call = re.search(r'custom_call_target="([^"]+)"', ins.attributes)
                target = call.group(1) if call else ins.op
            out.append(Kernel(ins.name, ins.op, target, ins.shape, moved, trips))

    walk("ENTRY", 1)
    return out
