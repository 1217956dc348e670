from __future__ import annotations

import contextlib
import io

import pytest

from pagedserve import kernels, model_metadata


def _metadata_in_process(*args: str) -> str:
    # The config and GGUF metadata reads the engine runs in a child process (model_metadata.py), here where
    # transformers is imported already: the same code, without a ~10 s interpreter start per model.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        model_metadata._main(*args)
    return out.getvalue()


@pytest.fixture
def model_cache(tmp_path, monkeypatch: pytest.MonkeyPatch):
    # A fresh PAGEDSERVE_CACHE_DIR for converted models and resolved configs. The kernels are loaded first,
    # from the real cache: under the new directory they would be built again (minutes).
    kernels.load()
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(model_metadata, "run", _metadata_in_process)
    return tmp_path
