"""SpecPipe: pipeline-parallel speculative decoding over a dynamic token tree."""

__version__ = "0.1.0"
