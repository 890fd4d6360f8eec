"""Errors of the model store and of resolving MODEL arguments (one line each, exit code 2)."""

from __future__ import annotations


class ModelNotFoundError(ValueError):
    """MODEL names nothing this machine has or can fetch."""


class StoreError(ModelNotFoundError):
    """Fetching or converting a model failed in a way the user can act on (one line, exit 2)."""
