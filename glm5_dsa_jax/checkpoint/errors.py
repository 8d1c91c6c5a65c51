"""``CheckpointError``: the one exception a failed checkpoint load or save raises.

It is a ``WeightError`` (``glm5_dsa_jax.model.weights``), so ``problems`` lists every issue found,
each naming its tensor or array: a loader collects all of them before it raises, never
stopping at the first, and returns nothing when it raises.
"""

from __future__ import annotations

from glm5_dsa_jax.model.weights import WeightError

__all__ = ["CheckpointError"]


class CheckpointError(WeightError):
    """A checkpoint cannot be loaded; ``problems`` lists every issue found."""
