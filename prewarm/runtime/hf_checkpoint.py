"""A Hugging Face checkpoint directory as a prewarm model directory (for external engines).

An agent books a replica's memory from its directory's `manifest.json` and resolves the
directory by it, whichever engine serves it. A checkpoint written for vLLM (config.json,
model.safetensors, tokenizer) gets the same manifest the built-in models carry, read from
the safetensors header and the bytes themselves: every tensor's name, shape, dtype, byte
range and sha256. `make_tiny_llama` writes the tiny Llama of `tiny_llama.py` (run by the
vLLM environment's interpreter, which has `tokenizers`) and its manifest.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

from prewarm.core.errors import PermanentError
from prewarm.runtime.manifest import MANIFEST_FILE, WEIGHTS_FILE, Manifest, ModelError, TensorEntry

_ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64",
              "I32": "int32", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def write_manifest(model_dir: str | Path, *, name: str, revision: str) -> Manifest:
    """Read model.safetensors and write manifest.json beside it."""
    path = Path(model_dir) / WEIGHTS_FILE
    try:
        with open(path, "rb") as f:
            hlen = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(hlen))
            base = 8 + hlen
            entries = []
            for tname, meta in sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                                      key=lambda kv: kv[1]["data_offsets"][0]):
                start, end = meta["data_offsets"]
                f.seek(base + start)
                data = f.read(end - start)
                entries.append(TensorEntry(tname, tuple(meta["shape"]), _ST_DTYPES.get(meta["dtype"], meta["dtype"]),
                                           base + start, end - start, hashlib.sha256(data).hexdigest()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelError(f"{path} is not a readable safetensors file: {exc!r}") from exc
    dtypes = {e.dtype for e in entries}
    manifest = Manifest(name=name, revision=revision, dtype=dtypes.pop() if len(dtypes) == 1 else "mixed",
                        file=WEIGHTS_FILE, file_bytes=path.stat().st_size, total_bytes=sum(e.length for e in entries),
                        tensors=tuple(entries))
    (Path(model_dir) / MANIFEST_FILE).write_text(manifest.to_json())
    return manifest


def make_tiny_llama(out: str | Path, python: str, *, name: str, revision: str, seed: int = 0,
                    scale_head: float | None = None, timeout_s: float = 300.0) -> Path:
    """Write the tiny Llama (see tiny_llama.py) with the vLLM environment's `python`, and its manifest."""
    script = Path(__file__).with_name("tiny_llama.py")
    cmd = [python, str(script), str(out), "--seed", str(seed)]
    if scale_head is not None:
        cmd += ["--scale-layer", repr(scale_head)]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.CalledProcessError as exc:
        raise PermanentError(f"building the tiny Llama failed: {exc.stderr[-2000:]}") from exc
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PermanentError(f"building the tiny Llama with {python} failed: {exc}") from exc
    write_manifest(out, name=name, revision=revision)
    return Path(out)
