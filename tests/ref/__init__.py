"""PyTorch reference implementations used by the numerical tests."""
