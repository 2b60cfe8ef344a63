"""The compile cache's file (``compile_cache.bin``): torch's portable cache artifacts and the compiled C++ kernels, in
a zip; written and read by :mod:`.cache`, which decides when and checks what for.
"""

from __future__ import annotations

import glob
import io
import os
import re
import sys
import time
import zipfile
from itertools import chain

ARTIFACTS = "torch_artifacts.bin"  # torch's portable artifacts, inside the zip
KERNELS = "kernels/"  # compiled C++ kernels, inside the zip, by their path in the inductor cache directory
_KERNEL_NAME = re.compile(r"^[A-Za-z0-9_]{2}/[A-Za-z0-9_]+(\.main)?\.so$")
_SINCE = time.time()  # kernels built in the inductor cache directory from now on are this process's


def pack(restored: list[str]) -> tuple[bytes, dict] | None:
    """(the zip's bytes, entries by kind) of what this process compiled or loaded (``restored``: kernels a loaded cache
    put into the inductor cache directory); None: nothing compiled."""
    import torch

    got = torch.compiler.save_cache_artifacts()
    if got is None:
        return None
    blob, info = got
    entries = {kind: len(keys) for kind, keys in info.artifacts.items() if keys}
    kernels = dict(kernel_files())
    root = _inductor_dir()
    for rel in restored:  # from a loaded cache, whether or not this run loaded them
        if os.path.isfile(os.path.join(root, rel)):
            kernels.setdefault(rel, os.path.join(root, rel))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        zf.writestr(ARTIFACTS, blob)
        for rel, path in sorted(kernels.items()):
            zf.write(path, KERNELS + rel)
    entries["kernels"] = len(kernels)
    return buf.getvalue(), entries


def unpack(data: bytes) -> tuple[dict, list[str]] | None:
    """Load a zip written by :func:`pack` into torch's caches and the inductor cache directory: (entries by kind, the
    kernels restored), or None where torch cannot read its artifacts; a bad zip raises."""
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        entries = _load_torch_artifacts(zf.read(ARTIFACTS))
        if entries is None:
            return None
        kernels = _restore_kernels(zf)
    entries["kernels"] = len(kernels)
    return entries, kernels


def _load_torch_artifacts(blob: bytes) -> dict | None:
    """``torch.compiler.load_cache_artifacts``, the artifacts also kept for this process's next save (so those this
    run never looks up still go on to its checkpoints); entries by kind, or None where torch cannot read them."""
    try:
        from torch.compiler._cache import CacheArtifactManager

        artifacts = CacheArtifactManager.deserialize(blob)
        if artifacts is None:
            return None
        info = CacheArtifactManager.populate_caches(artifacts)
        try:  # torch internals: if they move, entries this run never looks up are not carried on
            for artifact in chain(*artifacts.values()):
                if artifact not in CacheArtifactManager._seen_artifacts:
                    CacheArtifactManager._new_cache_artifacts[artifact.type()].append(artifact)
                    CacheArtifactManager._seen_artifacts.add(artifact)
        except Exception:  # pragma: no cover
            pass
    except ImportError:  # pragma: no cover - internals moved: the public call
        import torch

        info = torch.compiler.load_cache_artifacts(blob)
        if info is None:
            return None
    return {kind: len(keys) for kind, keys in info.artifacts.items() if keys}


def _restore_kernels(zf: zipfile.ZipFile) -> list[str]:
    """The compiled C++ kernels into this process's inductor cache directory (where not there already)."""
    root, restored = _inductor_dir(), []
    for name in zf.namelist():
        rel = name[len(KERNELS):] if name.startswith(KERNELS) else None
        if rel is None or not _KERNEL_NAME.match(rel):
            continue
        target = os.path.join(root, *rel.split("/"))
        if not os.path.exists(target):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            write_atomically(target, zf.read(name))
            os.chmod(target, 0o755)
        restored.append(rel)
    return restored


def _inductor_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def kernel_files() -> list[tuple[str, str]]:
    """(path inside the inductor cache directory, absolute path) of the compiled C++ kernels of this process: those it
    loaded, and those built since hf_speedup was imported (with inductor's probes of the CPU's vector ISA, which a
    fresh cache directory would build again too)."""
    if "torch._inductor.codecache" not in sys.modules:
        return []
    from torch._inductor import codecache

    keys: set[str] = set()
    for cls in (codecache.CppCodeCache, codecache.CppPythonBindingsCodeCache, codecache.CppWrapperCodeCache):
        keys.update(vars(cls).get("cache", {}))
    root, out = _inductor_dir(), []
    for path in glob.glob(os.path.join(glob.escape(root), "??", "*.so")):
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        if _KERNEL_NAME.match(rel) and (rel[3:].split(".")[0] in keys or os.path.getmtime(path) >= _SINCE):
            out.append((rel, path))
    return sorted(out)


def write_atomically(path: str, data: bytes) -> None:
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
