"""Float64 NumPy oracle: closed-form MSE loss and gradients of a biased Linear layer."""

import numpy as np


def linear_mse(x, y, kernel, bias):
    """``loss = mean((x W + b - y)^2)`` and its gradients, in float64.

    For B examples and K outputs, ``dL/dW = 2 / (B K) * x^T r`` and ``dL/db = 2 / (B K) * sum_i r_i`` with the
    residual ``r = x W + b - y``.
    """
    x, y, kernel, bias = (np.asarray(a, np.float64) for a in (x, y, kernel, bias))
    r = x @ kernel + bias - y
    scale = 2.0 / r.size
    return float(np.mean(r**2)), scale * x.T @ r, scale * r.sum(axis=0)


def sgd_oracle(x, y, kernel, bias, lr):
    """Loss and the parameters after one SGD step: ``(loss, kernel', bias')``."""
    loss, gk, gb = linear_mse(x, y, kernel, bias)
    return loss, np.asarray(kernel, np.float64) - lr * gk, np.asarray(bias, np.float64) - lr * gb
