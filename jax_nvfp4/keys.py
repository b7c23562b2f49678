"""How a PRNG key becomes the two uint32 words that key the
stochastic-rounding generator (``key_words``): once, at the public call
(``quantize``, ``dot``, ``ragged_dot``) or in a layer's key source; below
that, the words travel."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

__all__ = ["check_stochastic_size", "key_words", "shard_words", "warn_unused_key"]

# The pure-JAX twin counts Philox's block counters f // 16 in uint32 (2^36
# elements); the limit keeps a factor of two in hand.
_MAX_STOCHASTIC_ELEMENTS = 2**35


def warn_unused_key(key, stochastic: bool) -> None:
    if key is not None and not stochastic:
        warnings.warn(
            "a key was passed with rounding='nearest', which draws no random "
            "bits: it is ignored (pass rounding='stochastic' to use it)",
            stacklevel=3,
        )


def check_stochastic_size(size) -> None:
    # (A symbolic size, under jax.export's shape polymorphism, is not checked.)
    if isinstance(size, int) and size >= _MAX_STOCHASTIC_ELEMENTS:
        raise ValueError(
            f"stochastic rounding supports tensors of fewer than 2**35 elements; "
            f"this one has {size} — quantize it in pieces"
        )


def shard_words(words, stochastic: bool, size) -> jax.Array:
    """The words a shard quantizes with: ``words`` ([1, 2], from
    ``key_words``) where it rounds stochastically, zeros elsewhere."""
    if not stochastic:
        return jnp.zeros((1, 2), jnp.uint32)
    if words is None:
        raise ValueError(
            "stochastic rounding needs the words of a PRNG key (key_words(key))"
        )
    check_stochastic_size(size)
    return jnp.asarray(words, jnp.uint32).reshape(1, 2)


def key_words(key, stochastic: bool, size: int) -> jax.Array:
    """The two uint32 words that key the stochastic-rounding generator, [1, 2].

    A threefry key (``jax.random.key`` or a legacy ``PRNGKey``) is used as is;
    keys of other implementations are first hashed to two words.
    """
    if not stochastic:
        return jnp.zeros((1, 2), jnp.uint32)
    if key is None:
        raise ValueError(
            "rounding='stochastic' needs a PRNG key: pass key=jax.random.key(seed) "
            "(a new key each step)"
        )
    check_stochastic_size(size)
    if not hasattr(key, "dtype"):
        raise ValueError(
            "key must be a jax.random.key(...) or a uint32[2] PRNGKey, got "
            f"{type(key).__name__} {key!r}"
        )
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise ValueError(
                f"key must be a single PRNG key (shape ()), got shape {key.shape}"
            )
        data = jax.random.key_data(key)
        if data.shape != (2,) or data.dtype != jnp.uint32:
            data = jax.random.bits(key, (2,), jnp.uint32)
    else:
        if key.shape != (2,) or key.dtype != jnp.uint32:
            raise ValueError(
                "key must be a jax.random.key(...) or a uint32[2] PRNGKey, got "
                f"{key.dtype}{list(key.shape)}"
            )
        data = key
    return data.reshape(1, 2)
