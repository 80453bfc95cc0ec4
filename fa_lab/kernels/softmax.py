"""Chapter 2's story in code: softmax → safe softmax → online softmax.

All three compute the same thing on a 1-D NumPy vector; what differs is how many
passes over the data they make and whether large inputs overflow.
"""
from __future__ import annotations

import math

import numpy as np


def naive_softmax(x: np.ndarray) -> np.ndarray:
    """exp(x) / Σ exp(x): two passes, and exp(89) already overflows float32."""
    e = np.exp(x)
    return e / e.sum()


def safe_softmax(x: np.ndarray) -> np.ndarray:
    """Subtract the maximum first: three passes (max, sum, normalise), never overflows."""
    m = x.max()
    e = np.exp(x - m)
    return e / e.sum()


def online_normalizer(x: np.ndarray) -> tuple[float, float]:
    """One pass: the running max m and the running sum l = Σ exp(x_j - m).

    When a new element raises the maximum, the sum so far is rescaled by exp(m_old - m_new):
    the identity exp(a - m_new) = exp(a - m_old) · exp(m_old - m_new) is the whole trick.
    """
    m, l = -math.inf, 0.0
    for xj in x.astype(np.float64):
        m_new = max(m, xj)
        l = l * math.exp(m - m_new) + math.exp(xj - m_new)
        m = m_new
    return m, l


def online_softmax(x: np.ndarray) -> np.ndarray:
    """One pass for (m, l), then one to normalise: the normaliser never needs a stored row."""
    m, l = online_normalizer(x)
    return (np.exp(x.astype(np.float64) - m) / l).astype(x.dtype)


def merge(state_a: tuple[float, float], state_b: tuple[float, float]) -> tuple[float, float]:
    """Combine the (m, l) of two disjoint parts of a vector.

    It is associative and commutative, so parts can be reduced in any order or tree —
    across key tiles in one thread block, or across blocks (split-K, FlashDecoding).
    """
    (m_a, l_a), (m_b, l_b) = state_a, state_b
    m = max(m_a, m_b)
    if m == -math.inf:  # both parts empty
        return m, 0.0
    return m, l_a * math.exp(m_a - m) + l_b * math.exp(m_b - m)
