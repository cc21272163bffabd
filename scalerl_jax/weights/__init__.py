"""The learner's weight path: stream a version's shards chunk by chunk (`StreamPublisher`), serve
them from each learner process (`WeightSource`), and fetch them on a generator (`StreamFetcher`,
which returns a `FetchedWeights`).
JAX is imported only inside the functions that touch device arrays."""
from scalerl_jax.weights.source import WeightSource
from scalerl_jax.weights.stream import FetchedWeights, StreamFetcher, StreamPublisher

__all__ = ["FetchedWeights", "StreamFetcher", "StreamPublisher", "WeightSource"]
