"""The manifest of a model directory: every tensor's name, shape, dtype, byte range and sha256.

It is the contract between the file a model was written to and every replica that loads
it: the loader verifies what it reads against it, the snapshot store keys snapshots by its
checksum, and warm-replica validation checks the live model against it (computed from
here, never a hard-coded tensor count). Byte ranges are absolute offsets inside
`model.safetensors`, so a reader needs nothing but `os.pread`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from prewarm.core.errors import WeightsError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"


class ModelError(WeightsError):
    """A model directory, config or manifest is wrong; the message names what."""


class CorruptWeights(WeightsError):
    """A tensor's bytes, shape or dtype do not match the manifest; `tensor` names it."""

    def __init__(self, tensor: str, detail: str) -> None:
        super().__init__(f"tensor {tensor!r} is corrupt: {detail}")
        self.tensor = tensor
        self.detail = detail


def json_object(text: str, what: str, required: Iterable[str] = ()) -> dict[str, Any]:
    """Parse `text` as a JSON object holding every `required` key; ModelError naming `what` otherwise."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelError(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelError(f"{what} must hold an object")
    missing = [k for k in required if k not in data]
    if missing:
        raise ModelError(f"{what} is missing {', '.join(missing)}")
    return data


@dataclass(frozen=True)
class TensorEntry:
    """One tensor: where its bytes are in model.safetensors and what they hash to."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # "float32" | "float16" | "bfloat16"
    offset: int  # absolute byte offset inside model.safetensors
    length: int  # bytes
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TensorEntry":
        try:
            return cls(
                name=str(d["name"]),
                shape=tuple(int(x) for x in d["shape"]),
                dtype=str(d["dtype"]),
                offset=int(d["offset"]),
                length=int(d["length"]),
                sha256=str(d["sha256"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"manifest tensor entry {dict(d)!r} is malformed: {exc!r}") from exc


@dataclass(frozen=True)
class Manifest:
    """What a model directory holds; `checksum` identifies the exact weights."""

    name: str
    revision: str
    dtype: str
    file: str
    file_bytes: int
    total_bytes: int  # sum of the tensors' lengths
    tensors: tuple[TensorEntry, ...]

    @property
    def checksum(self) -> str:
        """sha256 over every tensor's name, shape, dtype and sha256, in order."""
        h = hashlib.sha256()
        for t in self.tensors:
            h.update(f"{t.name}|{list(t.shape)}|{t.dtype}|{t.sha256}\n".encode())
        return h.hexdigest()

    @property
    def key(self) -> str:
        return f"{self.name}@{self.revision}"

    def entry(self, name: str) -> TensorEntry:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"manifest has no tensor {name!r}")

    def shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """name -> (shape, dtype): what structural validation compares the live model to."""
        return {t.name: (t.shape, t.dtype) for t in self.tensors}

    def to_json(self) -> str:
        data = {
            "name": self.name,
            "revision": self.revision,
            "dtype": self.dtype,
            "file": self.file,
            "file_bytes": self.file_bytes,
            "total_bytes": self.total_bytes,
            "checksum": self.checksum,
            "tensors": [t.to_dict() for t in self.tensors],
        }
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        data = json_object(text, MANIFEST_FILE,
                           ("name", "revision", "dtype", "file", "file_bytes", "total_bytes", "tensors"))
        m = cls(
            name=str(data["name"]),
            revision=str(data["revision"]),
            dtype=str(data["dtype"]),
            file=str(data["file"]),
            file_bytes=int(data["file_bytes"]),
            total_bytes=int(data["total_bytes"]),
            tensors=tuple(TensorEntry.from_dict(t) for t in data["tensors"]),
        )
        if "checksum" in data and data["checksum"] != m.checksum:
            raise ModelError("manifest.json checksum does not match its tensor list (the manifest was edited)")
        if sum(t.length for t in m.tensors) != m.total_bytes:
            raise ModelError("manifest.json total_bytes is not the sum of its tensors' lengths")
        return m


def load_manifest(model_dir: str | Path) -> Manifest:
    path = Path(model_dir) / MANIFEST_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ModelError(f"{path} does not exist: not a model directory (run `prewarm make-model`)") from None
    return Manifest.from_json(text)
