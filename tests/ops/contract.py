"""The contract every primitive family keeps, as a test base.

A subclass names its family's primitive, its twin in ``jax_nvfp4.reference``
and a few cases (operands and params); ``implementations`` lists what must
agree with the twin on the CPU, by an explicit name (the primitive, i.e. the
CPU handler where one is built; the twin itself; a GEMM path's body). The
base then checks, for every case: each implementation equals the twin bit
for bit (``exact``; else within ``tolerance``), the eager call equals the
jitted one, and ``vmap`` equals a loop over the mapped items. Runs on the CPU
device: the GPU paths are checked against their twins in tests/backends.
A test module parametrizes ``case`` and ``implementation`` with
``generate_contract_tests`` (its ``pytest_generate_tests``).
"""

from __future__ import annotations

import functools

import jax
import numpy as np


def _host(out):
    return [np.asarray(a, np.float64) for a in jax.tree.leaves(out)]


def _equal(got, want, exact, tolerance):
    for g, w in zip(_host(got), _host(want), strict=True):
        assert g.shape == w.shape
        if exact:
            np.testing.assert_array_equal(g, w, strict=True)
        else:  # sums in another order: relative to the result's magnitude
            scale = np.nanmax(np.abs(w)) if w.size else 0.0
            np.testing.assert_allclose(g, w, rtol=tolerance, atol=tolerance * scale)


class PrimitiveContract:
    """Subclasses set ``primitive`` and ``twin`` (staticmethods) and
    ``cases()`` -> {name: (operands, params)}."""

    primitive = None
    twin = None
    # Bit for bit against the twin (else within ``tolerance``, relative to
    # the result's magnitude: float32 sums in another order).
    exact = True
    tolerance = 0.0
    # Whether vmap is bit for bit a loop (an XLA dot's order may depend on
    # the batch's shape).
    vmap_exact = True
    # Operands that vmap maps (by index; None: all); the others stay shared.
    mapped = None

    def cases(self) -> dict:
        raise NotImplementedError

    def implementations(self) -> dict:
        return {"primitive": self.primitive, "twin": self.twin}

    def _on_cpu(self, fn, operands, params):
        cpu = jax.devices("cpu")[0]
        with jax.default_device(cpu):
            operands = jax.device_put(operands, cpu)
            return jax.jit(functools.partial(fn, **params))(*operands)

    def test_implementation_equals_twin(self, case, implementation):
        operands, params = self.cases()[case]
        fn = self.implementations()[implementation]
        got = self._on_cpu(fn, operands, params)
        want = self._on_cpu(self.twin, operands, params)
        _equal(got, want, self.exact, self.tolerance)

    def test_eager_equals_jit(self, case):
        operands, params = self.cases()[case]
        cpu = jax.devices("cpu")[0]
        with jax.default_device(cpu):
            operands = jax.device_put(operands, cpu)
            eager = self.primitive(*operands, **params)
            jitted = jax.jit(functools.partial(self.primitive, **params))(*operands)
        _equal(eager, jitted, True, 0.0)

    def test_vmap_is_a_loop(self, case):
        operands, params = self.cases()[case]
        cpu = jax.devices("cpu")[0]
        with jax.default_device(cpu):
            operands = jax.device_put(operands, cpu)
            # Two items, each the case's operands: every item must give the
            # unmapped result (a batching rule that mixed items, or dropped
            # one's amax, would not).
            mapped = range(len(operands)) if self.mapped is None else self.mapped
            stacked = [
                jax.numpy.stack([a, a]) if i in mapped else a
                for i, a in enumerate(operands)
            ]
            axes = [0 if i in mapped else None for i in range(len(operands))]
            fn = functools.partial(self.primitive, **params)
            mapped = jax.jit(jax.vmap(fn, in_axes=axes))(*stacked)
            one = jax.jit(fn)(*operands)
        for item in range(2):
            got = jax.tree.map(lambda a, i=item: a[i], mapped)
            _equal(got, one, self.vmap_exact, self.tolerance or 1e-6)


def generate_contract_tests(metafunc):
    """``pytest_generate_tests`` of a module of contract subclasses: each
    class's cases and implementations."""
    cls = metafunc.cls
    if cls is None or not issubclass(cls, PrimitiveContract):
        return
    if "case" in metafunc.fixturenames:
        metafunc.parametrize("case", sorted(cls().cases()))
    if "implementation" in metafunc.fixturenames:
        metafunc.parametrize("implementation", sorted(cls().implementations()))
